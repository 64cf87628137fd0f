// F32 rows, padded with zeros to whole units of 32 values (32 words a unit).
fn unit(rb: u32, u: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let b = rb + u * 32u;
    for (var k = 0u; k < 8u; k++) {
        let i = b + 4u * k;
        o[k] = bitcast<vec4<f32>>(vec4<u32>(W[i], W[i + 1u], W[i + 2u], W[i + 3u]));
    }
    return o;
}
