// Q5_1: region A, the 16 nibble bytes of block g; region B, two words a block: f16 d and
// f16 m, then qh. x = d·q + m.
fn q5_1_four(dm: vec2<f32>, nib: vec4<u32>, qh: u32, s: u32) -> vec4<f32> {
    let q = nib | (bits4(qh, s) << vec4<u32>(4u));
    return dm.x * vec4<f32>(q) + dm.y;
}

fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let q = W[g];
    let dm = h2(wd(P.soff + 2u * g));
    let qh = wd(P.soff + 2u * g + 1u);
    o[0] = q5_1_four(dm, lo4(q.x), qh, 0u);
    o[1] = q5_1_four(dm, lo4(q.y), qh, 4u);
    o[2] = q5_1_four(dm, lo4(q.z), qh, 8u);
    o[3] = q5_1_four(dm, lo4(q.w), qh, 12u);
    o[4] = q5_1_four(dm, hi4(q.x), qh, 16u);
    o[5] = q5_1_four(dm, hi4(q.y), qh, 20u);
    o[6] = q5_1_four(dm, hi4(q.z), qh, 24u);
    o[7] = q5_1_four(dm, hi4(q.w), qh, 28u);
    return o;
}
