// Q2_K: region A, 4 vectors a block: the 64 bytes of qs; region B, five words a block: the
// 16 scale bytes (4-bit scale low, 4-bit min high), then f16 d, f16 dmin. Unit t (0..8) of a
// block is values 128·h + 32·k + l (h = t/4, k = t%4, l = 0..32): bits 2k, 2k+1 of
// qs[32h + l]; sub-block 8h + 2k + l/16; x = (d·sc)·q − dmin·m (d·sc and its product with
// q in 0..4 are exact in f32: one rounding, fused or not).
fn q2_k_four(dl: f32, ml: f32, w: u32, sh: u32) -> vec4<f32> {
    let q = (vec4<u32>(w) >> vec4<u32>(sh, sh + 8u, sh + 16u, sh + 24u)) & vec4<u32>(3u);
    return dl * vec4<f32>(q) - ml;
}

fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let blk = g / 8u;
    let t = g % 8u;
    let h = t / 4u;
    let k = t % 4u;
    let sb = P.soff + 5u * blk;
    let dm = h2(wd(sb + 4u));
    // Scale bytes 8h + 2k and + 1: bytes 2(k % 2) and + 1 of word 2h + k / 2.
    let sw = wd(sb + 2u * h + k / 2u);
    let sh = 2u * k;
    for (var i = 0u; i < 2u; i++) {
        let s = (sw >> (16u * (k % 2u) + 8u * i)) & 255u;
        let dl = dm.x * f32(s & 15u);
        let ml = dm.y * f32(s >> 4u);
        let q = W[4u * blk + 2u * h + i];
        o[4u * i] = q2_k_four(dl, ml, q.x, sh);
        o[4u * i + 1u] = q2_k_four(dl, ml, q.y, sh);
        o[4u * i + 2u] = q2_k_four(dl, ml, q.z, sh);
        o[4u * i + 3u] = q2_k_four(dl, ml, q.w, sh);
    }
    return o;
}
