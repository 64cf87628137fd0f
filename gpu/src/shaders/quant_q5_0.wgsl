// Q5_0, device block of 6 words: f16 d | 2 zero bytes | u32 qh | 16 bytes of nibbles.
// Bit j of qh is the fifth bit of value j; x = d·(q − 16).
fn unit(rb: u32, u: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let b = rb + u * 6u;
    let d = h2(W[b]).x;
    let qh = W[b + 1u];
    for (var k = 0u; k < 4u; k++) {
        let q = W[b + 2u + k];
        let ql = lo4(q) | (bits4(qh, 4u * k) << vec4<u32>(4u));
        let qu = hi4(q) | (bits4(qh, 16u + 4u * k) << vec4<u32>(4u));
        o[k] = d * vec4<f32>(vec4<i32>(ql) - vec4<i32>(16));
        o[k + 4u] = d * vec4<f32>(vec4<i32>(qu) - vec4<i32>(16));
    }
    return o;
}
