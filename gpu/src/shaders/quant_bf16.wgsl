// BF16 rows, padded with zeros to whole units of 32 values: 4 vectors a unit. A bf16 is
// the high half of an f32.
fn bf2(w: u32) -> vec2<f32> {
    return bitcast<vec2<f32>>(vec2<u32>(w << 16u, w & 0xffff0000u));
}

fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    for (var k = 0u; k < 4u; k++) {
        let q = W[4u * g + k];
        o[2u * k] = vec4<f32>(bf2(q.x), bf2(q.y));
        o[2u * k + 1u] = vec4<f32>(bf2(q.z), bf2(q.w));
    }
    return o;
}
