enable f16;

// F16 rows (padded to whole units of 32 values) read as native f16 (SHADER_F16): one
// 8-byte load and a widening conversion per four values instead of unpack2x16float. The
// conversion is exact, so the values are those of quant_f16.wgsl. This is the one place
// f16 is used: every other format's dequantized values (f16 scale × integer) are not all
// representable in f16, and the matvec is bound by memory bandwidth, not arithmetic, so
// f16 math would cost exactness for no speed.
@group(0) @binding(0) var<storage, read> W: array<vec4<f16>>;

fn unit(g: u32) -> array<vec4<f32>, 8> {
    var o: array<vec4<f32>, 8>;
    for (var k = 0u; k < 8u; k++) {
        o[k] = vec4<f32>(W[8u * g + k]);
    }
    return o;
}
