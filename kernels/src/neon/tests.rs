//! Every NEON level against the scalar reference on short and odd rows (the conformance suite
//! covers the level `RINGLLM_ISA` picks, on long rows), and the forms of one level against each
//! other, bit for bit.

use super::*;
use crate::quants::scalar_kernels;
use crate::types::ALL_TYPES;

/// The kernel tables of every level this CPU has, by name.
fn levels(ty: GgmlType) -> Vec<TypeKernels> {
    let mut out = Vec::new();
    let mut e = scalar_kernels(ty);
    specialize(&mut e);
    out.push(e);
    if available_dotprod() {
        let mut e = scalar_kernels(ty);
        specialize_dotprod(&mut e);
        out.push(e);
    }
    if available_i8mm() {
        let mut e = scalar_kernels(ty);
        specialize_i8mm(&mut e);
        out.push(e);
    }
    out
}

struct Rng(u32);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (self.0 >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
    }

    fn row(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// `rows` rows of `ty` quantized by the reference, `stride` bytes apart.
fn rows_of(ty: GgmlType, n: usize, rows: usize, pad: usize, rng: &mut Rng) -> (Vec<u8>, usize) {
    let rb = ty.row_bytes(n).expect("whole blocks");
    let stride = rb + pad;
    let mut v = vec![0u8; rows * stride];
    for r in 0..rows {
        (scalar_kernels(ty).quantize)(&rng.row(n), &mut v[r * stride..r * stride + rb]);
    }
    (v, stride)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every form of every level of `ty`, on rows of `blocks` blocks: dequantize bit-exact, dot
/// within 1e-5 of the reference (`exact`: equal to it), multi/rows/tile equal to the single dot
/// and every level equal to the first.
fn check(ty: GgmlType, blocks: &[usize], exact: bool) {
    let r = scalar_kernels(ty);
    let at = r.vec_dot_type;
    let mut rng = Rng(ty as u32 + 1);
    for &nb in blocks {
        let n = nb * ty.block_size().max(32);
        let (n_w, n_a) = (7, 6);
        let (w, ws) = rows_of(ty, n, n_w, 5, &mut rng);
        let (a, as_) = rows_of(at, n, n_a, 3, &mut rng);
        let mut first: Option<Vec<u32>> = None;
        for k in levels(ty) {
            let name = k.isa.name();
            let mut want = vec![0f32; n];
            let mut got = vec![1f32; n];
            (r.dequantize)(&w, &mut want);
            (k.dequantize)(&w, &mut got);
            assert_eq!(
                bits(&got),
                bits(&want),
                "{ty} {name} dequantize, {nb} blocks"
            );
            let mut singles = vec![0f32; n_a * n_w];
            for ar in 0..n_a {
                for o in 0..n_w {
                    let (wr, arow) = (&w[o * ws..], &a[ar * as_..]);
                    let want = (r.vec_dot)(n, wr, arow);
                    let got = (k.vec_dot)(n, wr, arow);
                    if exact {
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{ty} {name}: {got} vs {want}"
                        );
                    } else {
                        let scale = want.abs().max(1.0);
                        assert!(
                            (got - want).abs() <= 1e-5 * scale,
                            "{ty} {name}: {got} vs {want}"
                        );
                    }
                    singles[ar * n_w + o] = got;
                }
            }
            if let Some(multi) = k.vec_dot_multi {
                for o in 0..n_w {
                    for m in 1..=n_a {
                        let mut out = vec![0f32; m];
                        multi(n, &w[o * ws..], &a, as_, &mut out);
                        let want: Vec<f32> = (0..m).map(|ar| singles[ar * n_w + o]).collect();
                        assert_eq!(bits(&out), bits(&want), "{ty} {name} multi {m}, row {o}");
                    }
                }
            }
            if let Some(rows) = k.vec_dot_rows {
                for m in 1..=n_w {
                    let mut out = vec![0f32; m];
                    rows(n, &w, ws, &a, &mut out);
                    assert_eq!(bits(&out), bits(&singles[..m]), "{ty} {name} rows {m}");
                }
            }
            if let Some(tile) = k.vec_dot_tile {
                for (tw, ta) in [(1, 1), (2, 2), (3, 5), (7, 6), (4, 1)] {
                    let stride = tw + 2;
                    let mut out = vec![f32::NAN; ta * stride];
                    tile(n, &w, ws, tw, &a, as_, ta, &mut out, stride);
                    for ar in 0..ta {
                        assert_eq!(
                            bits(&out[ar * stride..ar * stride + tw]),
                            bits(&singles[ar * n_w..ar * n_w + tw]),
                            "{ty} {name} tile {tw}x{ta}, row {ar}"
                        );
                    }
                }
            }
            match &first {
                None => first = Some(bits(&singles)),
                Some(f) => assert_eq!(&bits(&singles), f, "{ty} {name}: differs between levels"),
            }
        }
    }
}

pub(super) fn check_legacy(ty: GgmlType) {
    check(ty, &[1, 2, 3, 4, 5, 7, 9], false);
}

pub(super) fn check_kquant(ty: GgmlType) {
    check(ty, &[1, 2, 3], true);
}

#[test]
fn legacy_formats_at_odd_block_counts() {
    use GgmlType as T;
    for ty in [T::Q4_0, T::Q4_1, T::Q5_0, T::Q5_1, T::Q8_0, T::Q8_1] {
        check(ty, &[1, 2, 3, 4, 5, 7, 9], false);
    }
}

#[test]
fn float_formats_at_odd_lengths() {
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        // 32 · k elements: 16-element steps, with and without a scalar tail.
        check(ty, &[1, 2, 3], false);
    }
    let r = scalar_kernels(GgmlType::F16);
    let mut rng = Rng(5);
    for n in [1usize, 7, 15, 16, 17, 33, 100] {
        let (w, _) = rows_of(GgmlType::F16, n, 1, 0, &mut rng);
        let (a, _) = rows_of(GgmlType::F32, n, 1, 0, &mut rng);
        for k in levels(GgmlType::F16) {
            let (want, got) = ((r.vec_dot)(n, &w, &a), (k.vec_dot)(n, &w, &a));
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "F16 n={n}"
            );
            let mut y = vec![0f32; n];
            let mut z = vec![1f32; n];
            (r.dequantize)(&w, &mut y);
            (k.dequantize)(&w, &mut z);
            assert_eq!(bits(&y), bits(&z), "F16 dequantize n={n}");
        }
    }
}

#[test]
fn f16_widening_is_exact() {
    for h in 0..=u16::MAX {
        let want = half::f16::from_bits(h).to_f32();
        // SAFETY: NEON is part of every aarch64 CPU.
        let got = unsafe { vgetq_lane_f32::<2>(f16x4(u64::from(h) << 32)) };
        if want.is_nan() {
            assert!(got.is_nan(), "{h:#x}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{h:#x}");
        }
    }
}

#[test]
fn every_type_has_a_neon_entry() {
    for ty in ALL_TYPES {
        for k in levels(ty) {
            assert_ne!(k.isa, Isa::Scalar, "{ty}");
        }
    }
}

/// The i8mm GEMM gives every (weight row, activation row) pair the decode kernel's bits, at
/// even and odd row counts and block counts, for a window of the prepared rows.
#[test]
fn i8mm_gemm_gives_the_decode_bits() {
    if !available_i8mm() {
        eprintln!("SKIPPED i8mm_gemm_gives_the_decode_bits: no FEAT_I8MM on this CPU");
        return;
    }
    use GgmlType as T;
    for ty in [
        T::Q4_0,
        T::Q4_1,
        T::Q5_0,
        T::Q5_1,
        T::Q8_0,
        T::Q8_1,
        T::IQ4_NL,
    ] {
        let mut k = scalar_kernels(ty);
        specialize_i8mm(&mut k);
        let gemm = k
            .gemm
            .expect("i8mm level has a GEMM for the 32-element formats");
        let at = k.vec_dot_type;
        let mut rng = Rng(ty as u32 + 77);
        for nb in [1usize, 2, 3, 5, 8] {
            let n = nb * 32;
            let (n_w, n_a) = (5, 7);
            let (w, ws) = rows_of(ty, n, n_w, 3, &mut rng);
            let (a, as_) = rows_of(at, n, n_a, 0, &mut rng);
            let mut acts = crate::gemm::GemmActs::new();
            acts.prepare(at, &a, as_, n_a, nb);
            for (r0, m) in [(0, n_a), (1, 3), (6, 1), (2, 2)] {
                for nw in [1, 2, n_w] {
                    let stride = nw + 1;
                    let mut out = vec![f32::NAN; m * stride];
                    gemm(n, &w, ws, nw, &acts, r0, m, &mut out, stride);
                    for r in 0..m {
                        for o in 0..nw {
                            let want = (k.vec_dot)(n, &w[o * ws..], &a[(r0 + r) * as_..]);
                            assert_eq!(
                                out[r * stride + o].to_bits(),
                                want.to_bits(),
                                "{ty} nb={nb}: weight row {o}, activation row {}",
                                r0 + r
                            );
                        }
                        assert!(out[r * stride + nw].is_nan(), "{ty}: wrote past the tile");
                    }
                }
            }
        }
    }
}
