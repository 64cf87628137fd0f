// IQ4_NL: region A, the 16 index bytes of block g (byte j: value j low nibble, value j + 16
// high); region B, the f16 scales d, two a word. x = d·KV[q] with the fixed codebook below
// (ggml's kvalues_iq4nl): one product, rounded once, as ringllm_kernels.

var<private> KV: array<f32, 16> = array<f32, 16>(
    -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
    1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0,
);

fn iq4_four(d: f32, q: vec4<u32>) -> vec4<f32> {
    return d * vec4<f32>(KV[q.x], KV[q.y], KV[q.z], KV[q.w]);
}

fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let q = W[g];
    let dd = h2(wd(P.soff + g / 2u));
    let d = select(dd.x, dd.y, g % 2u == 1u);
    o[0] = iq4_four(d, lo4(q.x));
    o[1] = iq4_four(d, lo4(q.y));
    o[2] = iq4_four(d, lo4(q.z));
    o[3] = iq4_four(d, lo4(q.w));
    o[4] = iq4_four(d, hi4(q.x));
    o[5] = iq4_four(d, hi4(q.y));
    o[6] = iq4_four(d, hi4(q.z));
    o[7] = iq4_four(d, hi4(q.w));
    return o;
}
