// Q4_1, device block of 5 words (the GGUF block): f16 d, f16 m | 16 bytes of nibbles;
// x = d·q + m (d·q is exact in f32, so a fused multiply-add rounds the same).
fn unit(rb: u32, u: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let b = rb + u * 5u;
    let dm = h2(W[b]);
    for (var k = 0u; k < 4u; k++) {
        let q = W[b + 1u + k];
        o[k] = dm.x * vec4<f32>(lo4(q)) + dm.y;
        o[k + 4u] = dm.x * vec4<f32>(hi4(q)) + dm.y;
    }
    return o;
}
