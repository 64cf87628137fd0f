//! GGML tensor element types as they appear in GGUF files.

use std::fmt;

/// A GGML element type. Discriminants are the ids used in GGUF tensor tables and are pinned by
/// a test: they are part of the file format.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    /// Activation format for Q4_1/Q5_1 dot products (never stored in model files we read).
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    /// Activation format for K-quant dot products.
    Q8_K = 15,
    BF16 = 30,
    /// Blocks of 32: an f16 scale and 4-bit indices into a fixed non-linear codebook.
    IQ4_NL = 20,
    /// Blocks of 256: an f16 scale, eight 6-bit sub-block scales and IQ4_NL's codebook.
    IQ4_XS = 23,
    /// Blocks of 32: a power-of-two (E8M0) scale byte and 4-bit E2M1 codes (gpt-oss).
    MXFP4 = 39,
}

/// Every type we implement, in id order.
pub const ALL_TYPES: [GgmlType; 18] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::BF16,
    GgmlType::MXFP4,
];

/// Elements per block of the K-quant formats.
pub const QK_K: usize = 256;

impl GgmlType {
    /// The type with GGUF id `id`, or `None` when we do not implement it.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        ALL_TYPES.iter().copied().find(|t| *t as u32 == id)
    }

    /// Name used by llama.cpp and gguf-py (`Q4_K`, `F32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q8_1 => "Q8_1",
            GgmlType::Q2_K => "Q2_K",
            GgmlType::Q3_K => "Q3_K",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::Q8_K => "Q8_K",
            GgmlType::BF16 => "BF16",
            GgmlType::IQ4_NL => "IQ4_NL",
            GgmlType::IQ4_XS => "IQ4_XS",
            GgmlType::MXFP4 => "MXFP4",
        }
    }

    /// The type named `name` (case-insensitive), for CLI flags and test parameters.
    pub fn from_name(name: &str) -> Option<GgmlType> {
        ALL_TYPES
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q8_1
            | GgmlType::IQ4_NL
            | GgmlType::MXFP4 => 32,
            GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::Q8_K
            | GgmlType::IQ4_XS => QK_K,
            GgmlType::Q2_K | GgmlType::Q3_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q8_1 => 36,
            GgmlType::Q4_K => 144,
            GgmlType::Q5_K => 176,
            GgmlType::Q6_K => 210,
            GgmlType::Q8_K => 292,
            GgmlType::Q2_K => 84,
            GgmlType::Q3_K => 110,
            GgmlType::IQ4_NL => 18,
            GgmlType::IQ4_XS => 136,
            GgmlType::MXFP4 => 17,
        }
    }

    /// Bytes taken by `n` elements, or `None` when `n` is not a whole number of blocks or
    /// the size overflows.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.type_size())
    }

    /// True for the types stored as plain floats (one element per block).
    pub fn is_float(self) -> bool {
        matches!(self, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_pinned_to_the_gguf_format() {
        let expected: [(GgmlType, u32); 18] = [
            (GgmlType::F32, 0),
            (GgmlType::F16, 1),
            (GgmlType::Q4_0, 2),
            (GgmlType::Q4_1, 3),
            (GgmlType::Q5_0, 6),
            (GgmlType::Q5_1, 7),
            (GgmlType::Q8_0, 8),
            (GgmlType::Q8_1, 9),
            (GgmlType::Q2_K, 10),
            (GgmlType::Q3_K, 11),
            (GgmlType::Q4_K, 12),
            (GgmlType::Q5_K, 13),
            (GgmlType::Q6_K, 14),
            (GgmlType::Q8_K, 15),
            (GgmlType::BF16, 30),
            (GgmlType::IQ4_NL, 20),
            (GgmlType::IQ4_XS, 23),
            (GgmlType::MXFP4, 39),
        ];
        for (t, id) in expected {
            assert_eq!(t as u32, id, "{t}");
            assert_eq!(GgmlType::from_id(id), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        assert_eq!(GgmlType::from_id(4), None); // Q4_2, removed from GGML
        assert_eq!(GgmlType::from_id(16), None); // IQ2_XXS, not implemented
    }

    #[test]
    fn row_bytes_checks_block_multiples() {
        assert_eq!(GgmlType::Q4_K.row_bytes(512), Some(288));
        assert_eq!(GgmlType::Q8_0.row_bytes(640), Some(680));
        assert_eq!(GgmlType::Q8_0.row_bytes(33), None);
        assert_eq!(GgmlType::F32.row_bytes(usize::MAX), None);
    }
}
