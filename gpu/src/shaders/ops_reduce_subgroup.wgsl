// Workgroup reductions with subgroup operations: one subgroup reduction, one partial per
// subgroup in shared memory, then every invocation adds the (few) partials in the same order.
// Prepended to every ops module built with subgroups; `WG` is defined before it.

struct Ids {
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_id) sg_id: u32,
    @builtin(num_subgroups) n_sg: u32,
}

var<workgroup> red: array<f32, WG>;

// The workgroup's index in a grid folded into two dimensions (65535 groups per dimension).
fn group_index(ids: Ids) -> u32 {
    return ids.wid.y * ids.nwg.x + ids.wid.x;
}

// Sum of `v` over the workgroup; every invocation gets it. Call in uniform control flow.
fn wg_sum(v: f32, ids: Ids) -> f32 {
    let s = subgroupAdd(v);
    if (ids.sg_lane == 0u) {
        red[ids.sg_id] = s;
    }
    workgroupBarrier();
    var t = 0.0;
    for (var i = 0u; i < ids.n_sg; i = i + 1u) {
        t = t + red[i];
    }
    workgroupBarrier();
    return t;
}

// Maximum of `v` over the workgroup; every invocation gets it. Call in uniform control flow.
fn wg_max(v: f32, ids: Ids) -> f32 {
    let s = subgroupMax(v);
    if (ids.sg_lane == 0u) {
        red[ids.sg_id] = s;
    }
    workgroupBarrier();
    var t = -3.0e38;
    for (var i = 0u; i < ids.n_sg; i = i + 1u) {
        t = max(t, red[i]);
    }
    workgroupBarrier();
    return t;
}

var<workgroup> red4: array<vec4<f32>, WG>;

// Lane-wise sum of `v` over the workgroup (four reductions at once).
fn wg_sum4(v: vec4<f32>, ids: Ids) -> vec4<f32> {
    let s = subgroupAdd(v);
    if (ids.sg_lane == 0u) {
        red4[ids.sg_id] = s;
    }
    workgroupBarrier();
    var t = vec4<f32>(0.0);
    for (var i = 0u; i < ids.n_sg; i = i + 1u) {
        t = t + red4[i];
    }
    workgroupBarrier();
    return t;
}

// Lane-wise maximum of `v` over the workgroup.
fn wg_max4(v: vec4<f32>, ids: Ids) -> vec4<f32> {
    let s = subgroupMax(v);
    if (ids.sg_lane == 0u) {
        red4[ids.sg_id] = s;
    }
    workgroupBarrier();
    var t = vec4<f32>(-3.0e38);
    for (var i = 0u; i < ids.n_sg; i = i + 1u) {
        t = max(t, red4[i]);
    }
    workgroupBarrier();
    return t;
}
