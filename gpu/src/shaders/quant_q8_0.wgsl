// Q8_0: region A, the 32 signed bytes of block g (two vectors); region B, the f16
// scales d, two a word. x = d·q.
fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let dd = h2(wd(P.soff + g / 2u));
    let d = select(dd.x, dd.y, g % 2u == 1u);
    for (var k = 0u; k < 2u; k++) {
        let q = W[2u * g + k];
        o[4u * k] = d * vec4<f32>(sbytes4(q.x));
        o[4u * k + 1u] = d * vec4<f32>(sbytes4(q.y));
        o[4u * k + 2u] = d * vec4<f32>(sbytes4(q.z));
        o[4u * k + 3u] = d * vec4<f32>(sbytes4(q.w));
    }
    return o;
}
