// MXFP4: region A, the 16 code bytes of block g (byte j: value j low nibble, value j + 16
// high); region B, the E8M0 scale bytes e, four a word. x = 2^(e - 128)·KV[q], KV the doubled
// E2M1 values (ggml's kvalues_mxfp4): the power of two is exact, so one product, rounded once,
// as ringllm_kernels.

var<private> KV: array<f32, 16> = array<f32, 16>(
    0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0,
    0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0,
);

fn fp4_four(d: f32, q: vec4<u32>) -> vec4<f32> {
    return d * vec4<f32>(KV[q.x], KV[q.y], KV[q.z], KV[q.w]);
}

fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let q = W[g];
    let e = (wd(P.soff + g / 4u) >> (8u * (g % 4u))) & 0xffu;
    let d = ldexp(1.0, i32(e) - 128);
    o[0] = fp4_four(d, lo4(q.x));
    o[1] = fp4_four(d, lo4(q.y));
    o[2] = fp4_four(d, lo4(q.z));
    o[3] = fp4_four(d, lo4(q.w));
    o[4] = fp4_four(d, hi4(q.x));
    o[5] = fp4_four(d, hi4(q.y));
    o[6] = fp4_four(d, hi4(q.z));
    o[7] = fp4_four(d, hi4(q.w));
    return o;
}
