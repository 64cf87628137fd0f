// Q5_0: region A, the 16 nibble bytes of block g; region B, two words a block: qh (bit j
// is the fifth bit of value j) and f16 d (low half). x = d·(q − 16).
fn q5_0_four(d: f32, nib: vec4<u32>, qh: u32, s: u32) -> vec4<f32> {
    let q = nib | (bits4(qh, s) << vec4<u32>(4u));
    return d * vec4<f32>(vec4<i32>(q) - vec4<i32>(16));
}

fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let q = W[g];
    let qh = wd(P.soff + 2u * g);
    let d = h2(wd(P.soff + 2u * g + 1u)).x;
    o[0] = q5_0_four(d, lo4(q.x), qh, 0u);
    o[1] = q5_0_four(d, lo4(q.y), qh, 4u);
    o[2] = q5_0_four(d, lo4(q.z), qh, 8u);
    o[3] = q5_0_four(d, lo4(q.w), qh, 12u);
    o[4] = q5_0_four(d, hi4(q.x), qh, 16u);
    o[5] = q5_0_four(d, hi4(q.y), qh, 20u);
    o[6] = q5_0_four(d, hi4(q.z), qh, 24u);
    o[7] = q5_0_four(d, hi4(q.w), qh, 28u);
    return o;
}
