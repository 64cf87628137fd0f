// Q6_K: region A, 12 vectors a block: 128 bytes ql | 64 bytes qh; region B, five words a
// block: the 16 i8 scales, then f16 d (low half). Unit t (0..8) of a block is values
// 128·h + 32·k + l (h = t/4, k = t%4, l = 0..32): low four bits from nibble k/2 of
// ql[64h + 32(k%2) + l], top two from bits 2k, 2k+1 of qh[32h + l]; scale
// scales[8h + 2k + l/16]; x = (d·sc)·(q − 32).
fn q6_k_four(ds: f32, l: u32, lsh: u32, h: u32, hsh: u32) -> vec4<f32> {
    let lo = (vec4<u32>(l) >> vec4<u32>(lsh, lsh + 8u, lsh + 16u, lsh + 24u)) & vec4<u32>(15u);
    let hi = (vec4<u32>(h) >> vec4<u32>(hsh, hsh + 8u, hsh + 16u, hsh + 24u)) & vec4<u32>(3u);
    return ds * vec4<f32>(vec4<i32>(lo | (hi << vec4<u32>(4u))) - vec4<i32>(32));
}

fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let blk = g / 8u;
    let t = g % 8u;
    let h = t / 4u;
    let k = t % 4u;
    let sb = P.soff + 5u * blk;
    let d = h2(wd(sb + 4u)).x;
    // Scales 8h + 2k and 8h + 2k + 1: bytes (2k) % 4 and + 1 of word 2h + k / 2.
    let sw = sbytes4(wd(sb + 2u * h + k / 2u));
    let s2 = select(sw.xy, sw.zw, k % 2u == 1u);
    let lsh = 4u * (k / 2u);
    let hsh = 2u * k;
    let a = 12u * blk;
    for (var i = 0u; i < 2u; i++) {
        // l = 16·i .. 16·i + 16: one vector of ql and one of qh, scale s2[i].
        let ds = d * f32(select(s2.x, s2.y, i == 1u));
        let lq = W[a + 4u * h + 2u * (k % 2u) + i];
        let hq = W[a + 8u + 2u * h + i];
        o[4u * i] = q6_k_four(ds, lq.x, lsh, hq.x, hsh);
        o[4u * i + 1u] = q6_k_four(ds, lq.y, lsh, hq.y, hsh);
        o[4u * i + 2u] = q6_k_four(ds, lq.z, lsh, hq.z, hsh);
        o[4u * i + 3u] = q6_k_four(ds, lq.w, lsh, hq.w, hsh);
    }
    return o;
}
