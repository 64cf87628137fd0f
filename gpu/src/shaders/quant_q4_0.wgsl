// Q4_0, device block of 5 words: f16 d | 2 zero bytes | 16 bytes of nibbles.
// Value j (0..16) is the low nibble of byte j, value j + 16 the high nibble; x = d·(q − 8).
fn unit(rb: u32, u: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let b = rb + u * 5u;
    let d = h2(W[b]).x;
    for (var k = 0u; k < 4u; k++) {
        let q = W[b + 1u + k];
        o[k] = d * vec4<f32>(vec4<i32>(lo4(q)) - vec4<i32>(8));
        o[k + 4u] = d * vec4<f32>(vec4<i32>(hi4(q)) - vec4<i32>(8));
    }
    return o;
}
