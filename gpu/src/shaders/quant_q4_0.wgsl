// Q4_0: region A, the 16 nibble bytes of block g (byte j: value j low, value j + 16
// high); region B, the f16 scales d, two a word. x = d·(q − 8).
fn q4_0_half(d: f32, w: u32, hi: bool) -> vec4<f32> {
    let q = select(lo4(w), hi4(w), hi);
    return d * vec4<f32>(vec4<i32>(q) - vec4<i32>(8));
}

fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let q = W[g];
    let dd = h2(wd(P.soff + g / 2u));
    let d = select(dd.x, dd.y, g % 2u == 1u);
    for (var k = 0u; k < 2u; k++) {
        let hi = k == 1u;
        o[4u * k] = q4_0_half(d, q.x, hi);
        o[4u * k + 1u] = q4_0_half(d, q.y, hi);
        o[4u * k + 2u] = q4_0_half(d, q.z, hi);
        o[4u * k + 3u] = q4_0_half(d, q.w, hi);
    }
    return o;
}
