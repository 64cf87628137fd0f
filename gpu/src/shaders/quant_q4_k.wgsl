// Q4_K: region A holds the GGUF blocks unchanged, 9 vectors a block: f16 d, f16 dmin and
// 12 bytes of packed 6-bit scales and mins | 128 bytes of nibbles. Unit j (0..8) of a
// block is sub-block j: the low (j even) or high (j odd) nibbles of bytes 32·(j/2) .. +32;
// x = (d·sc)·q − dmin·m (both products exact in f32).

// Scale and min of sub-block j from the scale words a, b, c (get_scale_min_k4).
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

fn q4_k_four(d1: f32, m1: f32, w: u32, sh: u32) -> vec4<f32> {
    let q = (vec4<u32>(w) >> vec4<u32>(sh, sh + 8u, sh + 16u, sh + 24u)) & vec4<u32>(15u);
    return d1 * vec4<f32>(q) - m1;
}

fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let base = (g / 8u) * 9u;
    let j = g % 8u;
    let hdr = W[base];
    let dm = h2(hdr.x);
    let sm = scale_min_k4(hdr.y, hdr.z, hdr.w, j);
    let d1 = dm.x * f32(sm.x);
    let m1 = dm.y * f32(sm.y);
    let sh = 4u * (j % 2u);
    for (var k = 0u; k < 2u; k++) {
        let q = W[base + 1u + 2u * (j / 2u) + k];
        o[4u * k] = q4_k_four(d1, m1, q.x, sh);
        o[4u * k + 1u] = q4_k_four(d1, m1, q.y, sh);
        o[4u * k + 2u] = q4_k_four(d1, m1, q.z, sh);
        o[4u * k + 3u] = q4_k_four(d1, m1, q.w, sh);
    }
    return o;
}
