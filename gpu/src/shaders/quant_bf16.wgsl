// BF16 rows, padded with zeros to whole units of 32 values (16 words a unit). A bf16 is
// the high half of an f32.
fn bf2(w: u32) -> vec2<f32> {
    return bitcast<vec2<f32>>(vec2<u32>(w << 16u, w & 0xffff0000u));
}

fn unit(rb: u32, u: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let b = rb + u * 16u;
    for (var k = 0u; k < 8u; k++) {
        o[k] = vec4<f32>(bf2(W[b + 2u * k]), bf2(W[b + 2u * k + 1u]));
    }
    return o;
}
