//! The GGML type table: every tensor type id upstream ggml defines, with its
//! block size (elements) and block byte size.

use std::fmt;

/// A GGML tensor type, identified by its on-disk id (`ggml_type` in `ggml.h`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
    NVFP4 = 40,
    Q1_0 = 41,
    Q2_0 = 42,
}

/// One row of the type table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TypeTraits {
    /// Name as ggml prints it (`"q4_K"` is printed as `"Q4_K"` here).
    pub name: &'static str,
    /// Elements per block (1 for plain types).
    pub block_size: usize,
    /// Bytes per block.
    pub type_size: usize,
}

macro_rules! table {
    ($($v:ident => ($name:literal, $bs:expr, $ts:expr)),* $(,)?) => {
        impl GgmlType {
            /// Every type this table knows, in id order.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$v),*];

            /// The type with this on-disk id, if ggml defines one.
            pub fn from_id(id: u32) -> Option<GgmlType> {
                $(if id == GgmlType::$v as u32 { return Some(GgmlType::$v); })*
                None
            }

            /// Block size, byte size and name.
            pub const fn traits(self) -> TypeTraits {
                match self {
                    $(GgmlType::$v => TypeTraits { name: $name, block_size: $bs, type_size: $ts },)*
                }
            }
        }
    };
}

// Sizes from ggml-common.h / ggml.c `type_traits` (QK_K = 256).
table! {
    F32 => ("F32", 1, 4),
    F16 => ("F16", 1, 2),
    Q4_0 => ("Q4_0", 32, 18),
    Q4_1 => ("Q4_1", 32, 20),
    Q5_0 => ("Q5_0", 32, 22),
    Q5_1 => ("Q5_1", 32, 24),
    Q8_0 => ("Q8_0", 32, 34),
    Q8_1 => ("Q8_1", 32, 36),
    Q2_K => ("Q2_K", 256, 84),
    Q3_K => ("Q3_K", 256, 110),
    Q4_K => ("Q4_K", 256, 144),
    Q5_K => ("Q5_K", 256, 176),
    Q6_K => ("Q6_K", 256, 210),
    Q8_K => ("Q8_K", 256, 292),
    IQ2_XXS => ("IQ2_XXS", 256, 66),
    IQ2_XS => ("IQ2_XS", 256, 74),
    IQ3_XXS => ("IQ3_XXS", 256, 98),
    IQ1_S => ("IQ1_S", 256, 50),
    IQ4_NL => ("IQ4_NL", 32, 18),
    IQ3_S => ("IQ3_S", 256, 110),
    IQ2_S => ("IQ2_S", 256, 82),
    IQ4_XS => ("IQ4_XS", 256, 136),
    I8 => ("I8", 1, 1),
    I16 => ("I16", 1, 2),
    I32 => ("I32", 1, 4),
    I64 => ("I64", 1, 8),
    F64 => ("F64", 1, 8),
    IQ1_M => ("IQ1_M", 256, 56),
    BF16 => ("BF16", 1, 2),
    TQ1_0 => ("TQ1_0", 256, 54),
    TQ2_0 => ("TQ2_0", 256, 66),
    MXFP4 => ("MXFP4", 32, 17),
    NVFP4 => ("NVFP4", 64, 36),
    Q1_0 => ("Q1_0", 128, 18),
    Q2_0 => ("Q2_0", 64, 18),
}

impl GgmlType {
    /// The on-disk id.
    pub const fn id(self) -> u32 {
        self as u32
    }
    /// Elements per block.
    pub const fn block_size(self) -> usize {
        self.traits().block_size
    }
    /// Bytes per block.
    pub const fn type_size(self) -> usize {
        self.traits().type_size
    }
    /// Whether this type stores weights in blocks (anything but plain scalars).
    pub const fn is_quantized(self) -> bool {
        self.traits().block_size > 1
    }
    /// Bytes needed for `n_elements` values, or `None` when `n_elements` is not a
    /// whole number of blocks or the product overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if bs == 0 || !n_elements.is_multiple_of(bs) {
            return None;
        }
        (n_elements / bs).checked_mul(self.type_size() as u64)
    }
    /// Bits per weight.
    pub fn bits_per_weight(self) -> f64 {
        let t = self.traits();
        if t.block_size == 0 {
            return 0.0;
        }
        (t.type_size * 8) as f64 / t.block_size as f64
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.traits().name)
    }
}
