// F16 rows, padded with zeros to whole units of 32 values (16 words a unit).
fn unit(rb: u32, u: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let b = rb + u * 16u;
    for (var k = 0u; k < 8u; k++) {
        o[k] = vec4<f32>(h2(W[b + 2u * k]), h2(W[b + 2u * k + 1u]));
    }
    return o;
}
