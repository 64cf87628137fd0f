// Q8_0, device block of 9 words: f16 d | 2 zero bytes | 32 signed bytes; x = d·q.
fn unit(rb: u32, u: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let b = rb + u * 9u;
    let d = h2(W[b]).x;
    for (var k = 0u; k < 8u; k++) {
        o[k] = d * vec4<f32>(sbytes4(W[b + 1u + k]));
    }
    return o;
}
