// Q6_K, device block of 53 words: 128 bytes ql | 64 bytes qh | 16 i8 scales | f16 d |
// 2 zero bytes. Unit t (0..8) of a block is values 128·h + 32·k + l (h = t/4, k = t%4,
// l = 0..32): low four bits from nibble k/2 of ql[64h + 32(k%2) + l], top two from bits
// 2k, 2k+1 of qh[32h + l]; scale scales[8h + 2k + l/16]; x = (d·sc)·(q − 32).
fn unit(rb: u32, u: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let b = rb + (u / 8u) * 53u;
    let t = u % 8u;
    let h = t / 4u;
    let k = t % 4u;
    let d = h2(W[b + 52u]).x;
    let s = 8u * h + 2u * k;
    let sw = sbytes4(W[b + 48u + s / 4u]);
    // s is even: the two scales are bytes s%4 and s%4 + 1 of one word.
    let ds0 = d * f32(sw[s % 4u]);
    let ds1 = d * f32(sw[s % 4u + 1u]);
    let l0 = b + 16u * h + 8u * (k % 2u);
    let lsh = 4u * (k / 2u);
    let h0 = b + 32u + 8u * h;
    for (var i = 0u; i < 8u; i++) {
        let lo = (vec4<u32>(W[l0 + i]) >> vec4<u32>(lsh, lsh + 8u, lsh + 16u, lsh + 24u)) & vec4<u32>(15u);
        let hi = (vec4<u32>(W[h0 + i]) >> vec4<u32>(2u * k, 2u * k + 8u, 2u * k + 16u, 2u * k + 24u)) & vec4<u32>(3u);
        let q = vec4<i32>(lo | (hi << vec4<u32>(4u))) - vec4<i32>(32);
        let ds = select(ds1, ds0, i < 4u);
        o[i] = ds * vec4<f32>(q);
    }
    return o;
}
