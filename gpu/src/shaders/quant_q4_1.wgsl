// Q4_1: region A, the 16 nibble bytes of block g; region B, f16 d and f16 m, a word a
// block. x = d·q + m (d·q is exact in f32, so a fused multiply-add rounds the same).
fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    let q = W[g];
    let dm = h2(wd(P.soff + g));
    o[0] = dm.x * vec4<f32>(lo4(q.x)) + dm.y;
    o[1] = dm.x * vec4<f32>(lo4(q.y)) + dm.y;
    o[2] = dm.x * vec4<f32>(lo4(q.z)) + dm.y;
    o[3] = dm.x * vec4<f32>(lo4(q.w)) + dm.y;
    o[4] = dm.x * vec4<f32>(hi4(q.x)) + dm.y;
    o[5] = dm.x * vec4<f32>(hi4(q.y)) + dm.y;
    o[6] = dm.x * vec4<f32>(hi4(q.z)) + dm.y;
    o[7] = dm.x * vec4<f32>(hi4(q.w)) + dm.y;
    return o;
}
