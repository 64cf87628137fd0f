// Shared declarations of the quantized matmul shaders. qmat.rs composes a module as: the
// weight binding W (matmul_weights_u32.wgsl, or a format's native-f16 file, which also
// defines `unit`), this file, the format's `unit` function (quant_<format>.wgsl), and one
// kernel's entry point (matmul_matvec.wgsl + matmul_reduce_*.wgsl, matmul_tiled.wgsl,
// matmul_dequant.wgsl). `unit(g)` returns the 32 values of unit g = row·upr + u of the
// chunk (values 32·u .. 32·u + 32 of that row), dequantized to f32 exactly as
// ringllm_kernels does.
//
// W holds one chunk of rows of a matrix in its device layout (see qmat.rs): region A, 16
// bytes or more a block, aligned to 16 (quants, or whole K-quant blocks), from word 0;
// region B (the legacy formats' and Q6_K's scales), a few bytes a block, from word
// `soff`. X and Y are whole f32 buffers addressed from element offsets in the uniform
// parameters.

struct Params {
    // Rows in this chunk, units (32 values) per row, word offset of region B, activation
    // rows.
    rows: u32,
    upr: u32,
    soff: u32,
    n: u32,
    // X[x_off + m * x_stride + c]; Y[y_off + m * y_stride + row_base + r].
    x_off: u32,
    x_stride: u32,
    y_off: u32,
    y_stride: u32,
    // Matrix row of this chunk's first row; logical columns; workgroups along x of a
    // 2-D grid (65535 per dimension at most).
    row_base: u32,
    cols: u32,
    grid_x: u32,
    _pad: u32,
}

@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read_write> Y: array<f32>;
@group(0) @binding(3) var<uniform> P: Params;

// The two f16 halves of a word (low first), exactly widened to f32.
fn h2(w: u32) -> vec2<f32> {
    return unpack2x16float(w);
}

// Low and high nibbles of the four bytes of a word.
fn lo4(w: u32) -> vec4<u32> {
    return (vec4<u32>(w) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(15u);
}

fn hi4(w: u32) -> vec4<u32> {
    return (vec4<u32>(w) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(15u);
}

// The four bytes of a word as signed 8-bit integers.
fn sbytes4(w: u32) -> vec4<i32> {
    let i = bitcast<i32>(w);
    return vec4<i32>(i << 24u, i << 16u, i << 8u, i) >> vec4<u32>(24u);
}

// Bit `s + k` of `w` for k = 0..4.
fn bits4(w: u32, s: u32) -> vec4<u32> {
    return (vec4<u32>(w) >> (vec4<u32>(0u, 1u, 2u, 3u) + vec4<u32>(s))) & vec4<u32>(1u);
}
