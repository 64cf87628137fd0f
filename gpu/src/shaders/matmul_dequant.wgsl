// Dequantization to f32 (checks and debugging): invocation i writes unit i % upr of row
// i / upr to Y[y_off + (row_base + row)·y_stride + 32·unit ..].
@compute @workgroup_size(64)
fn dequant(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let id = (wid.y * P.grid_x + wid.x) * 64u + lid;
    let r = id / P.upr;
    let u = id % P.upr;
    if (r < P.rows) {
        var w = unit(r * P.upr + u);
        let o = P.y_off + (P.row_base + r) * P.y_stride + 32u * u;
        for (var k = 0u; k < 8u; k++) {
            for (var c = 0u; c < 4u; c++) {
                Y[o + 4u * k + c] = w[k][c];
            }
        }
    }
}
