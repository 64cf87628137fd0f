//! AVX2 dot products for the 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) against
//! Q8_0/Q8_1 activations. Each weight block is expanded once to 32 signed or unsigned bytes in
//! one register, then multiplied with every activation row of a tile (`vec_dot_multi`).

use crate::quants::common::check_dot;
use std::arch::x86_64::*;

/// Which block format a kernel instance decodes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fmt {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
}

impl Fmt {
    const fn block(self) -> usize {
        match self {
            Fmt::Q4_0 => 18,
            Fmt::Q4_1 => 20,
            Fmt::Q5_0 => 22,
            Fmt::Q5_1 => 24,
            Fmt::Q8_0 => 34,
        }
    }

    /// Activation block: Q8_1 (36 B, with sum) for the formats with a minimum.
    const fn act_block(self) -> usize {
        match self {
            Fmt::Q4_1 | Fmt::Q5_1 => 36,
            _ => 34,
        }
    }

    /// Offset of the quants inside an activation block.
    const fn act_qs(self) -> usize {
        match self {
            Fmt::Q4_1 | Fmt::Q5_1 => 4,
            _ => 2,
        }
    }

    /// Signed weights use the abs/sign trick; unsigned ones feed maddubs directly.
    const fn signed(self) -> bool {
        matches!(self, Fmt::Q4_0 | Fmt::Q5_0 | Fmt::Q8_0)
    }

    const fn has_min(self) -> bool {
        matches!(self, Fmt::Q4_1 | Fmt::Q5_1)
    }
}

#[inline(always)]
fn f16(b: *const u8) -> f32 {
    // SAFETY: callers pass a pointer to two readable bytes inside a checked block.
    half::f16::from_le_bytes(unsafe { [*b, *b.add(1)] }).to_f32()
}

/// 32 nibbles from 16 bytes: low nibbles in bytes 0..16, high nibbles in 16..32.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: p points at 16 readable bytes (checked block).
    let x = unsafe { _mm_loadu_si128(p as *const __m128i) };
    let lo = _mm_and_si128(x, _mm_set1_epi8(0x0f));
    let hi = _mm_and_si128(_mm_srli_epi16(x, 4), _mm_set1_epi8(0x0f));
    _mm256_set_m128i(hi, lo)
}

/// 32 bytes, each 0xFF where the corresponding bit of `bits` is set.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bits_to_bytes(bits: u32) -> __m256i {
    let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    let v = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuf);
    let mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64);
    let v = _mm256_or_si256(v, mask);
    _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1))
}

/// The 32 weights of block `b` as bytes: signed (`Fmt::signed`) or unsigned.
#[inline(always)]
unsafe fn decode(fmt: Fmt, b: *const u8) -> __m256i {
    // SAFETY (whole function): `b` points at a whole block of `fmt` (checked by callers);
    // AVX2 is enabled in every caller.
    unsafe {
        match fmt {
            Fmt::Q8_0 => _mm256_loadu_si256(b.add(2) as *const __m256i),
            Fmt::Q4_0 => _mm256_sub_epi8(nibbles(b.add(2)), _mm256_set1_epi8(8)),
            Fmt::Q4_1 => nibbles(b.add(4)),
            Fmt::Q5_0 => {
                let qh = u32::from_le_bytes([*b.add(2), *b.add(3), *b.add(4), *b.add(5)]);
                // (n | h<<4) - 16 == n | 0xF0 when h == 0, n when h == 1.
                let hi = _mm256_andnot_si256(bits_to_bytes(qh), _mm256_set1_epi8(0xf0u8 as i8));
                _mm256_or_si256(nibbles(b.add(6)), hi)
            }
            Fmt::Q5_1 => {
                let qh = u32::from_le_bytes([*b.add(4), *b.add(5), *b.add(6), *b.add(7)]);
                let hi = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10));
                _mm256_or_si256(nibbles(b.add(8)), hi)
            }
        }
    }
}

/// Σ w·a over 32 bytes as 8 i32 lanes converted to float.
#[inline(always)]
unsafe fn block_dot(signed: bool, w: __m256i, a: __m256i) -> __m256 {
    // SAFETY: AVX2 is enabled in every caller; register-only operations.
    unsafe {
        let p16 = if signed {
            let aw = _mm256_sign_epi8(w, w);
            let sa = _mm256_sign_epi8(a, w);
            _mm256_maddubs_epi16(aw, sa)
        } else {
            _mm256_maddubs_epi16(w, a)
        };
        _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)))
    }
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    // SAFETY: register-only AVX operations; AVX2 is enabled in every caller.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}

/// `out[r] = dot(w, a_r)` for `R` activation rows `a + r*stride`.
#[inline(always)]
unsafe fn dot_rows<const R: usize>(fmt: Fmt, nb: usize, w: *const u8, a: *const u8, stride: usize, out: &mut [f32]) {
    let (wb, ab, aq) = (fmt.block(), fmt.act_block(), fmt.act_qs());
    // SAFETY: callers checked that `w` holds `nb` weight blocks and every activation row
    // `nb` activation blocks; AVX2+FMA are enabled in every caller.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); R];
        let mut mins = [0f32; R];
        for i in 0..nb {
            let bw = w.add(i * wb);
            let qw = decode(fmt, bw);
            let dw = f16(bw);
            for r in 0..R {
                let ba = a.add(r * stride + i * ab);
                let qa = _mm256_loadu_si256(ba.add(aq) as *const __m256i);
                let d = _mm256_set1_ps(dw * f16(ba));
                acc[r] = _mm256_fmadd_ps(d, block_dot(fmt.signed(), qw, qa), acc[r]);
                if fmt.has_min() {
                    mins[r] += f16(bw.add(2)) * f16(ba.add(2));
                }
            }
        }
        for r in 0..R {
            out[r] = hsum(acc[r]) + mins[r];
        }
    }
}

macro_rules! kernels {
    ($dot:ident, $multi:ident, $fmt:expr) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $dot(nb: usize, w: *const u8, a: *const u8, out: &mut [f32]) {
            // SAFETY: forwarded from the safe wrapper, which checked the lengths.
            unsafe { dot_rows::<1>($fmt, nb, w, a, 0, out) }
        }

        /// Safe entry: one weight row against one activation row.
        pub fn $multi(n: usize, w: &[u8], a: &[u8], stride: usize, out: &mut [f32]) {
            let fmt = $fmt;
            let nb = check_dot(n, 32, w, fmt.block(), a, fmt.act_block());
            let rows = out.len();
            if rows > 1 {
                assert!(a.len() >= (rows - 1) * stride + nb * fmt.act_block(), "activation rows too short");
            }
            let mut r = 0;
            while r < rows {
                let left = rows - r;
                // SAFETY: AVX2+FMA+F16C were detected before this table entry was installed;
                // lengths checked above.
                unsafe {
                    let ap = a.as_ptr().add(r * stride);
                    if left >= 4 {
                        tile::<4>(fmt, nb, w.as_ptr(), ap, stride, &mut out[r..r + 4]);
                        r += 4;
                    } else if left >= 2 {
                        tile::<2>(fmt, nb, w.as_ptr(), ap, stride, &mut out[r..r + 2]);
                        r += 2;
                    } else {
                        $dot(nb, w.as_ptr(), ap, &mut out[r..r + 1]);
                        r += 1;
                    }
                }
            }
        }
    };
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const R: usize>(fmt: Fmt, nb: usize, w: *const u8, a: *const u8, stride: usize, out: &mut [f32]) {
    // SAFETY: forwarded from the safe wrapper, which checked the lengths.
    unsafe { dot_rows::<R>(fmt, nb, w, a, stride, out) }
}

kernels!(dot_q4_0, multi_q4_0, Fmt::Q4_0);
kernels!(dot_q4_1, multi_q4_1, Fmt::Q4_1);
kernels!(dot_q5_0, multi_q5_0, Fmt::Q5_0);
kernels!(dot_q5_1, multi_q5_1, Fmt::Q5_1);
kernels!(dot_q8_0, multi_q8_0, Fmt::Q8_0);

macro_rules! single {
    ($name:ident, $multi:ident) => {
        pub fn $name(n: usize, w: &[u8], a: &[u8]) -> f32 {
            let mut out = [0f32; 1];
            $multi(n, w, a, 0, &mut out);
            out[0]
        }
    };
}

single!(vec_dot_q4_0, multi_q4_0);
single!(vec_dot_q4_1, multi_q4_1);
single!(vec_dot_q5_0, multi_q5_0);
single!(vec_dot_q5_1, multi_q5_1);
single!(vec_dot_q8_0, multi_q8_0);
