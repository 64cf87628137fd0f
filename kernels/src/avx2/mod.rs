//! AVX2+FMA kernels, one file per format family. Chosen at start-up by `available()`;
//! every `unsafe fn` here is `#[target_feature(enable = "avx2,fma,f16c")]` and only called
//! after detection succeeded.

use crate::dispatch::{Isa, TypeKernels};

pub mod ops;
use crate::types::GgmlType;

mod float;
pub mod gemm512;
mod iq4_nl;
mod iq4_xs;
mod kgemm;
mod kquant;
mod mxfp4;
mod mxfp4_panel;
mod q2_k;
mod q3_k;
mod q4_0;
mod q4_1;
mod q4_k;
mod q4_k_panel;
mod q5_0;
mod q5_1;
mod q5_k;
mod q6_k;
mod q8_0;
mod q8_k;

/// True when this CPU has every feature the AVX2 kernels use.
pub fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// AVX2 and AVX-VNNI (256-bit `vpdpbusd`, VEX: Alder Lake, Sapphire Rapids and later).
pub fn available_avxvnni() -> bool {
    available() && is_x86_feature_detected!("avxvnni")
}

/// AVX2 and AVX-512 VNNI with VL (`vpdpbusd` on 256-bit registers, EVEX: Ice Lake, Zen 4).
pub fn available_avx512vnni() -> bool {
    available() && is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl")
}

/// Which `vpdpbusd` the VNNI level uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vnni {
    Avx,
    Avx512,
}

/// The VNNI instruction this CPU has, AVX-VNNI first (shorter encoding).
pub fn vnni() -> Option<Vnni> {
    if available_avxvnni() {
        Some(Vnni::Avx)
    } else if available_avx512vnni() {
        Some(Vnni::Avx512)
    } else {
        None
    }
}

/// The AVX2 table, then the legacy formats' dot products with `vpdpbusd` (their integer
/// sums are exact either way, so results do not change; the K-quants keep their AVX2 loops,
/// which scale 16-bit partial sums before widening).
pub fn specialize_vnni(entry: &mut TypeKernels, v: Vnni) {
    specialize(entry);
    entry.isa = Isa::Avx2Vnni;
    macro_rules! set {
        ($m:ident, $b:ty) => {{
            entry.vec_dot = q8_0::$m::vec_dot::<$b>;
            entry.vec_dot_multi = Some(q8_0::$m::vec_dot_multi::<$b>);
            entry.vec_dot_rows = Some(q8_0::$m::vec_dot_rows::<$b>);
            entry.vec_dot_tile = Some(q8_0::$m::vec_dot_tile::<$b>);
        }};
    }
    macro_rules! level {
        ($b:ty) => {
            match v {
                Vnni::Avx => set!(avxvnni, $b),
                Vnni::Avx512 => set!(avx512vnni, $b),
            }
        };
    }
    if entry.ty != GgmlType::MXFP4 {
        entry.kgemm = kgemm_for(entry.ty, KLevel::Vnni(v));
    }
    match entry.ty {
        GgmlType::Q4_0 => level!(q4_0::Q4_0),
        GgmlType::Q4_1 => level!(q4_1::Q4_1),
        GgmlType::Q5_0 => level!(q5_0::Q5_0),
        GgmlType::Q5_1 => level!(q5_1::Q5_1),
        GgmlType::Q8_0 => level!(q8_0::Q8_0),
        GgmlType::Q8_1 => level!(q8_0::Q8_1),
        GgmlType::IQ4_NL => level!(iq4_nl::Iq4Nl),
        GgmlType::MXFP4 => match v {
            Vnni::Avx => mxfp4_entry::<mxfp4_panel::AvxVnni>(entry),
            Vnni::Avx512 => mxfp4_entry::<mxfp4_panel::Avx512Vnni>(entry),
        },
        GgmlType::Q4_K => {
            entry.dot_panels = Some(match v {
                Vnni::Avx => q4_k_panel::avxvnni::dot_panels,
                Vnni::Avx512 => q4_k_panel::avx512vnni::dot_panels,
            })
        }
        _ => {}
    }
}

/// The VNNI table plus the AVX-512 prefill GEMM of the 32-element formats.
pub fn specialize_avx512(entry: &mut TypeKernels, v: Vnni) {
    specialize_vnni(entry, v);
    entry.isa = Isa::Avx512;
    if entry.ty != GgmlType::MXFP4 {
        entry.kgemm = kgemm_for(entry.ty, KLevel::Avx512);
    }
    entry.gemm = match entry.ty {
        GgmlType::Q4_0 => Some(gemm512::gemm::<q4_0::Q4_0>),
        GgmlType::Q4_1 => Some(gemm512::gemm::<q4_1::Q4_1>),
        GgmlType::Q5_0 => Some(gemm512::gemm::<q5_0::Q5_0>),
        GgmlType::Q5_1 => Some(gemm512::gemm::<q5_1::Q5_1>),
        GgmlType::Q8_0 => Some(gemm512::gemm::<q8_0::Q8_0>),
        GgmlType::Q8_1 => Some(gemm512::gemm::<q8_0::Q8_1>),
        GgmlType::IQ4_NL => Some(gemm512::gemm::<iq4_nl::Iq4Nl>),
        _ => None,
    };
    entry.gemm_packed = match entry.ty {
        GgmlType::Q4_0 => Some(gemm512::gemm_packed::<q4_0::Q4_0>),
        GgmlType::Q4_1 => Some(gemm512::gemm_packed::<q4_1::Q4_1>),
        GgmlType::Q5_0 => Some(gemm512::gemm_packed::<q5_0::Q5_0>),
        GgmlType::Q5_1 => Some(gemm512::gemm_packed::<q5_1::Q5_1>),
        GgmlType::Q8_0 => Some(gemm512::gemm_packed::<q8_0::Q8_0>),
        GgmlType::IQ4_NL => Some(gemm512::gemm_packed::<iq4_nl::Iq4Nl>),
        _ => None,
    };
    // The K-quants' batch rows go 512 bits wide (the same bits as AVX2). Decode: Q6_K, Q3_K
    // and IQ4_XS take 512-bit dots with VNNI (`vpdpwssd`/`vpdpbusd`; L2-resident rows on a
    // Zen 4 EPYC: Q6_K 9.0 -> 6.5 ns a block, IQ4_XS 10.9 -> 6.8, Q3_K 8.8 -> 8.4); Q4_K,
    // Q5_K and Q2_K keep the AVX2 rows, which were as fast (a 512-bit Q4_K 7.1 ns against
    // 6.9: its 512-bit operations are two passes on Zen 4, and the activations' halves must
    // be paired to the nibbles' order). The float formats' dots go 16 lanes wide.
    match entry.ty {
        GgmlType::F32 => float512_entry::<float::F32>(entry),
        GgmlType::F16 => float512_entry::<float::F16>(entry),
        GgmlType::BF16 => float512_entry::<float::BF16>(entry),
        GgmlType::Q4_K => {
            entry.vec_dot_multi = Some(q4_k::vec_dot_multi512);
            entry.dot_panels = Some(q4_k_panel::dot_panels512);
        }
        GgmlType::Q5_K => entry.vec_dot_multi = Some(q5_k::vec_dot_multi512),
        GgmlType::Q6_K => {
            entry.vec_dot = q6_k::vec_dot512;
            entry.vec_dot_multi = Some(q6_k::vec_dot_multi512);
        }
        GgmlType::Q2_K => entry.vec_dot_multi = Some(q2_k::vec_dot_multi512),
        GgmlType::MXFP4 => mxfp4_entry::<mxfp4_panel::Avx512>(entry),
        GgmlType::Q3_K => {
            entry.vec_dot = q3_k::vec_dot512;
            entry.vec_dot_multi = Some(q3_k::vec_dot_multi512);
        }
        GgmlType::IQ4_XS => {
            entry.vec_dot = iq4_xs::vec_dot512;
            entry.vec_dot_multi = Some(iq4_xs::vec_dot_multi512);
        }
        _ => {}
    }
}

/// Replace the scalar functions of `entry` with AVX2 ones where we have them.
pub fn specialize(entry: &mut TypeKernels) {
    entry.isa = Isa::Avx2;
    // Per-format overrides are added here as they are written.
    match entry.ty {
        // 32-element block formats and floats (q4_0.rs … q8_0.rs, float.rs).
        GgmlType::F32 => float_entry::<float::F32>(entry),
        GgmlType::F16 => {
            float_entry::<float::F16>(entry);
            entry.quantize = float::quantize_f16;
        }
        GgmlType::BF16 => float_entry::<float::BF16>(entry),
        GgmlType::Q4_0 => legacy_entry::<q4_0::Q4_0>(entry),
        GgmlType::Q4_1 => legacy_entry::<q4_1::Q4_1>(entry),
        GgmlType::Q5_0 => legacy_entry::<q5_0::Q5_0>(entry),
        GgmlType::Q5_1 => legacy_entry::<q5_1::Q5_1>(entry),
        GgmlType::Q8_0 => {
            legacy_entry::<q8_0::Q8_0>(entry);
            // Activations are quantized to Q8_0 on every token: byte-identical to the
            // reference.
            entry.quantize = q8_0::quantize_q8_0;
        }
        GgmlType::Q8_1 => {
            legacy_entry::<q8_0::Q8_1>(entry);
            entry.quantize = q8_0::quantize_q8_1;
        }
        GgmlType::Q4_K => {
            // Weights are quantized by `convert` and `debug synth`: the reference's bytes.
            entry.quantize = kquant::quantize_q4_k;
            entry.dequantize = q4_k::dequantize;
            entry.vec_dot = q4_k::vec_dot;
            entry.vec_dot_multi = Some(q4_k::vec_dot_multi);
            entry.dot_panels = Some(q4_k_panel::plain::dot_panels);
        }
        GgmlType::Q5_K => {
            entry.quantize = kquant::quantize_q5_k;
            entry.dequantize = q5_k::dequantize;
            entry.vec_dot = q5_k::vec_dot;
            entry.vec_dot_multi = Some(q5_k::vec_dot_multi);
        }
        GgmlType::Q6_K => {
            entry.quantize = kquant::quantize_q6_k;
            entry.dequantize = q6_k::dequantize;
            entry.vec_dot = q6_k::vec_dot;
            entry.vec_dot_multi = Some(q6_k::vec_dot_multi);
        }
        GgmlType::Q8_K => {
            // Activations are quantized to Q8_K on every token: the AVX2 quantizer is
            // byte-identical to the reference.
            entry.dequantize = q8_k::dequantize;
            entry.quantize = q8_k::quantize;
        }
        // Dequantize stays the reference's (embedding rows only); the dots are bit-identical
        // to it.
        GgmlType::Q2_K => {
            entry.vec_dot = q2_k::vec_dot;
            entry.vec_dot_multi = Some(q2_k::vec_dot_multi);
        }
        GgmlType::Q3_K => {
            entry.quantize = kquant::quantize_q3_k;
            entry.vec_dot = q3_k::vec_dot;
            entry.vec_dot_multi = Some(q3_k::vec_dot_multi);
        }
        GgmlType::IQ4_NL => legacy_entry::<iq4_nl::Iq4Nl>(entry),
        GgmlType::IQ4_XS => {
            entry.vec_dot = iq4_xs::vec_dot;
            entry.vec_dot_multi = Some(iq4_xs::vec_dot_multi);
        }
        // Its one-row dot, and the rest through panels of 16 rows in the lanes of a register
        // (`mxfp4_panel.rs`): the reference's bits everywhere.
        GgmlType::MXFP4 => {
            entry.vec_dot = mxfp4::vec_dot;
            mxfp4_entry::<mxfp4_panel::Plain>(entry);
        }
    }
    // The K-quants' prefill through tiles of unpacked rows; IQ4_XS's codes (up to 241) would
    // saturate `maddubs`, so it waits for `vpdpbusd`.
    if entry.ty != GgmlType::MXFP4 {
        entry.kgemm = kgemm_for(entry.ty, KLevel::Avx2);
    }
}

/// Which K-quant GEMM a table level takes.
#[derive(Clone, Copy)]
enum KLevel {
    Avx2,
    Vnni(Vnni),
    Avx512,
}

fn kgemm_for(ty: GgmlType, level: KLevel) -> Option<crate::dispatch::KGemmFn> {
    use crate::ktile::{Iq4Xs, Q2K, Q3K, Q4K, Q5K, Q6K};
    macro_rules! pick {
        ($f:ident) => {
            match ty {
                GgmlType::Q4_K => Some($f::<Q4K>),
                GgmlType::Q5_K => Some($f::<Q5K>),
                GgmlType::Q6_K => Some($f::<Q6K>),
                GgmlType::Q3_K => Some($f::<Q3K>),
                GgmlType::Q2_K => Some($f::<Q2K>),
                GgmlType::IQ4_XS => Some($f::<Iq4Xs>),
                _ => None,
            }
        };
    }
    use kgemm::{
        avx512vnni::kgemm as k512vl, avxvnni::kgemm as kavx, kgemm512, plain::kgemm as k2,
    };
    match level {
        KLevel::Avx2 if ty == GgmlType::IQ4_XS => None,
        KLevel::Avx2 => pick!(k2),
        KLevel::Vnni(Vnni::Avx) => pick!(kavx),
        KLevel::Vnni(Vnni::Avx512) => pick!(k512vl),
        KLevel::Avx512 => pick!(kgemm512),
    }
}

/// MXFP4's panel kernels at level `L`: decode and prefill over repacked panels, and the
/// row kernels (rows in the GGUF layout, laid out as panels on the way).
fn mxfp4_entry<L: mxfp4_panel::Level + crate::repack::mxpanel::PanelKernel>(
    entry: &mut TypeKernels,
) {
    use crate::repack::mxpanel;
    entry.dot_panels = Some(mxfp4_panel::dot_panels::<L>);
    entry.gemm_panels = Some(mxfp4_panel::gemm_panels::<L>);
    entry.vec_dot_rows = Some(mxpanel::vec_dot_rows::<L>);
    entry.vec_dot_tile = Some(mxpanel::vec_dot_tile::<L>);
    entry.kgemm = Some(mxpanel::kgemm::<L>);
}

fn legacy_entry<B: q8_0::Legacy>(entry: &mut TypeKernels) {
    entry.dequantize = q8_0::dequantize::<B>;
    entry.vec_dot = q8_0::vec_dot::<B>;
    entry.vec_dot_multi = Some(q8_0::vec_dot_multi::<B>);
    entry.vec_dot_rows = Some(q8_0::vec_dot_rows::<B>);
    entry.vec_dot_tile = Some(q8_0::vec_dot_tile::<B>);
}

fn float512_entry<F: float::FloatFormat>(entry: &mut TypeKernels) {
    entry.vec_dot = float::vec_dot512::<F>;
    entry.vec_dot_multi = Some(float::vec_dot_multi512::<F>);
}

fn float_entry<F: float::FloatFormat>(entry: &mut TypeKernels) {
    entry.dequantize = float::dequantize::<F>;
    entry.vec_dot = float::vec_dot::<F>;
    entry.vec_dot_multi = Some(float::vec_dot_multi::<F>);
}
