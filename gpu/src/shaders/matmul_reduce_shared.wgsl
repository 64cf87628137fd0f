// Matvec entry point, workgroup-memory variant (no subgroup operations): a tree
// reduction of each row's 16 partials.
var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn matvec(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let row0 = (wid.y * P.grid_x + wid.x) * MV_ROWS;
    red[lid] = mv_partial(lid, row0);
    let lane = lid % MV_TPR;
    for (var s = MV_TPR / 2u; s > 0u; s >>= 1u) {
        workgroupBarrier();
        if (lane < s) {
            red[lid] += red[lid + s];
        }
    }
    workgroupBarrier();
    if (lid < MV_ROWS) {
        mv_store(row0, lid, red[lid * MV_TPR]);
    }
}
