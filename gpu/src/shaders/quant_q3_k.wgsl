// Q3_K: region A, 6 vectors a block: hmask[32] | qs[64]; region B, four words a block: the 12
// bytes of packed 6-bit scales, then f16 d (low half). Unit t (0..8) of a block is values
// 128·h + 32·k + l (h = t/4, k = t%4, l = 0..32): low bits 2k, 2k+1 of qs[32h + l], third bit
// t of hmask[l]; sub-block j = 8h + 2k + l/16 with scale s: low four bits the nibble j/8 of
// byte j%8, top two bits 2(j/4), +1 of byte 8 + j%4; x = (d·(s − 32))·(q − 4) (exact in f32).
fn q3_k_four(dl: f32, l: u32, lsh: u32, hm: u32, hsh: u32) -> vec4<f32> {
    let lo = (vec4<u32>(l) >> vec4<u32>(lsh, lsh + 8u, lsh + 16u, lsh + 24u)) & vec4<u32>(3u);
    let hi = (vec4<u32>(hm) >> vec4<u32>(hsh, hsh + 8u, hsh + 16u, hsh + 24u)) & vec4<u32>(1u);
    return dl * vec4<f32>(vec4<i32>(lo | (hi << vec4<u32>(2u))) - vec4<i32>(4));
}

fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let blk = g / 8u;
    let t = g % 8u;
    let h = t / 4u;
    let k = t % 4u;
    let sb = P.soff + 4u * blk;
    let d = h2(wd(sb + 3u)).x;
    let top = wd(sb + 2u);
    let lsh = 2u * k;
    for (var i = 0u; i < 2u; i++) {
        let j = 8u * h + 2u * k + i;
        let b = j % 8u;
        let low = (wd(sb + b / 4u) >> (8u * (b % 4u) + 4u * (j / 8u))) & 15u;
        let high = (top >> (8u * (j % 4u) + 2u * (j / 4u))) & 3u;
        let dl = d * f32(i32(low | (high << 4u)) - 32);
        let q = W[6u * blk + 2u + 2u * h + i];
        let m = W[6u * blk + i];
        o[4u * i] = q3_k_four(dl, q.x, lsh, m.x, t);
        o[4u * i + 1u] = q3_k_four(dl, q.y, lsh, m.y, t);
        o[4u * i + 2u] = q3_k_four(dl, q.z, lsh, m.z, t);
        o[4u * i + 3u] = q3_k_four(dl, q.w, lsh, m.w, t);
    }
    return o;
}
