// F32 rows, padded with zeros to whole units of 32 values: 8 vectors a unit.
fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    for (var k = 0u; k < 8u; k++) {
        o[k] = bitcast<vec4<f32>>(W[8u * g + k]);
    }
    return o;
}
