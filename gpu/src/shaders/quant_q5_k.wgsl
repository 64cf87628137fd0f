// Q5_K, device block of 44 words (the GGUF block): f16 d, f16 dmin | 12 bytes of scales
// and mins (as Q4_K) | 32 bytes qh | 128 bytes of nibbles. Unit j is sub-block j: nibbles
// as Q4_K, fifth bit of value i is bit j of qh[i]; x = (d·sc)·q − dmin·m.
fn scale_min_k4(b: u32, j: u32) -> vec2<u32> {
    let a = W[b + 1u];
    let bb = W[b + 2u];
    let c = W[b + 3u];
    if (j < 4u) {
        return vec2<u32>((a >> (8u * j)) & 63u, (bb >> (8u * j)) & 63u);
    }
    let s = 8u * (j - 4u);
    return vec2<u32>(
        ((c >> s) & 15u) | (((a >> (s + 6u)) & 3u) << 4u),
        ((c >> (s + 4u)) & 15u) | (((bb >> (s + 6u)) & 3u) << 4u),
    );
}

fn unit(rb: u32, u: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let b = rb + (u / 8u) * 44u;
    let j = u % 8u;
    let dm = h2(W[b]);
    let sm = scale_min_k4(b, j);
    let d1 = dm.x * f32(sm.x);
    let m1 = dm.y * f32(sm.y);
    let q0 = b + 12u + 8u * (j / 2u);
    let sh = 4u * (j % 2u);
    for (var k = 0u; k < 8u; k++) {
        let nib = (vec4<u32>(W[q0 + k]) >> vec4<u32>(sh, sh + 8u, sh + 16u, sh + 24u)) & vec4<u32>(15u);
        let hb = (vec4<u32>(W[b + 4u + k]) >> vec4<u32>(j, j + 8u, j + 16u, j + 24u)) & vec4<u32>(1u);
        o[k] = d1 * vec4<f32>(nib | (hb << vec4<u32>(4u))) - m1;
    }
    return o;
}
