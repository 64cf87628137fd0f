// Q5_K: region A holds the GGUF blocks unchanged, 11 vectors a block: f16 d, f16 dmin and
// 12 bytes of scales and mins (as Q4_K) | 32 bytes qh | 128 bytes of nibbles. Unit j is
// sub-block j: nibbles as Q4_K, the fifth bit of its value i is bit j of qh[i];
// x = (d·sc)·q − dmin·m.
fn scale_min_k4(a: u32, b: u32, c: u32, j: u32) -> vec2<u32> {
    if (j < 4u) {
        return vec2<u32>((a >> (8u * j)) & 63u, (b >> (8u * j)) & 63u);
    }
    let s = 8u * (j - 4u);
    return vec2<u32>(
        ((c >> s) & 15u) | (((a >> (s + 6u)) & 3u) << 4u),
        ((c >> (s + 4u)) & 15u) | (((b >> (s + 6u)) & 3u) << 4u),
    );
}

fn q5_k_four(d1: f32, m1: f32, w: u32, sh: u32, h: u32, j: u32) -> vec4<f32> {
    let nib = (vec4<u32>(w) >> vec4<u32>(sh, sh + 8u, sh + 16u, sh + 24u)) & vec4<u32>(15u);
    let hb = (vec4<u32>(h) >> vec4<u32>(j, j + 8u, j + 16u, j + 24u)) & vec4<u32>(1u);
    return d1 * vec4<f32>(nib | (hb << vec4<u32>(4u))) - m1;
}

fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let base = (g / 8u) * 11u;
    let j = g % 8u;
    let hdr = W[base];
    let dm = h2(hdr.x);
    let sm = scale_min_k4(hdr.y, hdr.z, hdr.w, j);
    let d1 = dm.x * f32(sm.x);
    let m1 = dm.y * f32(sm.y);
    let sh = 4u * (j % 2u);
    for (var k = 0u; k < 2u; k++) {
        let q = W[base + 3u + 2u * (j / 2u) + k];
        let h = W[base + 1u + k];
        o[4u * k] = q5_k_four(d1, m1, q.x, sh, h.x, j);
        o[4u * k + 1u] = q5_k_four(d1, m1, q.y, sh, h.y, j);
        o[4u * k + 2u] = q5_k_four(d1, m1, q.z, sh, h.z, j);
        o[4u * k + 3u] = q5_k_four(d1, m1, q.w, sh, h.w, j);
    }
    return o;
}
