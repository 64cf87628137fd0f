// Q5_1, device block of 6 words (the GGUF block): f16 d, f16 m | u32 qh | 16 bytes of
// nibbles; x = d·q + m.
fn unit(rb: u32, u: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let b = rb + u * 6u;
    let dm = h2(W[b]);
    let qh = W[b + 1u];
    for (var k = 0u; k < 4u; k++) {
        let q = W[b + 2u + k];
        let ql = lo4(q) | (bits4(qh, 4u * k) << vec4<u32>(4u));
        let qu = hi4(q) | (bits4(qh, 16u + 4u * k) << vec4<u32>(4u));
        o[k] = dm.x * vec4<f32>(ql) + dm.y;
        o[k + 4u] = dm.x * vec4<f32>(qu) + dm.y;
    }
    return o;
}
