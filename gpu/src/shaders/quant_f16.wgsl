// F16 rows, padded with zeros to whole units of 32 values: 4 vectors a unit.
fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    for (var k = 0u; k < 4u; k++) {
        let q = W[4u * g + k];
        o[2u * k] = vec4<f32>(h2(q.x), h2(q.y));
        o[2u * k + 1u] = vec4<f32>(h2(q.z), h2(q.w));
    }
    return o;
}
