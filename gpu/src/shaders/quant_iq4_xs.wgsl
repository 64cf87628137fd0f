// IQ4_XS: region A, the 128 index bytes of each block (8 vectors: vector j is sub-block j,
// byte k value k low nibble, value k + 16 high); region B, the block's first 8 bytes, two
// words: f16 d | u16 scales_h, then scales_l[4]. Unit g is sub-block g % 8 of block g / 8,
// scale ls = scales_l nibble | two bits of scales_h << 4; x = (d·(ls − 32))·KV[q] (the first
// product exact in f32, the second rounded once, as ringllm_kernels).

var<private> KV: array<f32, 16> = array<f32, 16>(
    -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
    1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0,
);

fn iq4_four(d: f32, q: vec4<u32>) -> vec4<f32> {
    return d * vec4<f32>(KV[q.x], KV[q.y], KV[q.z], KV[q.w]);
}

fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let blk = g / 8u;
    let j = g % 8u;
    let h0 = wd(P.soff + 2u * blk);
    let sl = wd(P.soff + 2u * blk + 1u);
    let d = h2(h0).x;
    let ls = ((sl >> (4u * j)) & 15u) | (((h0 >> (16u + 2u * j)) & 3u) << 4u);
    let dl = d * f32(i32(ls) - 32);
    let q = W[g];
    o[0] = iq4_four(dl, lo4(q.x));
    o[1] = iq4_four(dl, lo4(q.y));
    o[2] = iq4_four(dl, lo4(q.z));
    o[3] = iq4_four(dl, lo4(q.w));
    o[4] = iq4_four(dl, hi4(q.x));
    o[5] = iq4_four(dl, hi4(q.y));
    o[6] = iq4_four(dl, hi4(q.z));
    o[7] = iq4_four(dl, hi4(q.w));
    return o;
}
