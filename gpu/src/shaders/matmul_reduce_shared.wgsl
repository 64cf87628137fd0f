// Matvec entry point, workgroup-memory variant (no subgroup operations): a tree
// reduction of the 64 partial vec4s.
var<workgroup> red: array<vec4<f32>, 64>;

@compute @workgroup_size(64)
fn matvec(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let row0 = (wid.y * P.grid_x + wid.x) * MV_ROWS;
    red[lid] = mv_partial(lid, row0);
    for (var s = 32u; s > 0u; s >>= 1u) {
        workgroupBarrier();
        if (lid < s) {
            red[lid] += red[lid + s];
        }
    }
    workgroupBarrier();
    if (lid < MV_ROWS) {
        mv_store(row0, lid, red[0][lid]);
    }
}
