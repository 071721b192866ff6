//! Element types: [`DType`], its sizes and its names (ours and safetensors').

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Element types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    /// IEEE binary64.
    F64,
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
    /// FP8 E4M3 (OCP, finite-only).
    F8E4m3,
    /// FP8 E5M2.
    F8E5m2,
    /// Signed integers.
    I64,
    /// Signed integers.
    I32,
    /// Signed integers.
    I16,
    /// Signed integers.
    I8,
    /// Unsigned integers.
    U64,
    /// Unsigned integers.
    U32,
    /// Unsigned integers.
    U16,
    /// Unsigned integers.
    U8,
    /// One byte, 0 or 1.
    Bool,
}

impl DType {
    /// All dtypes.
    pub const ALL: [DType; 15] = [
        DType::F64,
        DType::F32,
        DType::F16,
        DType::Bf16,
        DType::F8E4m3,
        DType::F8E5m2,
        DType::I64,
        DType::I32,
        DType::I16,
        DType::I8,
        DType::U64,
        DType::U32,
        DType::U16,
        DType::U8,
        DType::Bool,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::Bf16 | DType::I16 | DType::U16 => 2,
            DType::F8E4m3 | DType::F8E5m2 | DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// Floating point (the byte-plane codec is meant for these).
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F64 | DType::F32 | DType::F16 | DType::Bf16 | DType::F8E4m3 | DType::F8E5m2
        )
    }

    /// The name ckpt uses (`bf16`, `f8_e4m3`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F8E4m3 => "f8_e4m3",
            DType::F8E5m2 => "f8_e5m2",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::I16 => "i16",
            DType::I8 => "i8",
            DType::U64 => "u64",
            DType::U32 => "u32",
            DType::U16 => "u16",
            DType::U8 => "u8",
            DType::Bool => "bool",
        }
    }

    /// The safetensors dtype string (`BF16`, `F8_E4M3`, ...).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F64 => "F64",
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::Bf16 => "BF16",
            DType::F8E4m3 => "F8_E4M3",
            DType::F8E5m2 => "F8_E5M2",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::I16 => "I16",
            DType::I8 => "I8",
            DType::U64 => "U64",
            DType::U32 => "U32",
            DType::U16 => "U16",
            DType::U8 => "U8",
            DType::Bool => "BOOL",
        }
    }

    /// The dtype of a safetensors dtype string.
    pub fn from_safetensors_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.safetensors_name() == s)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.to_ascii_lowercase();
        DType::ALL
            .into_iter()
            .find(|d| d.name() == lower || d.safetensors_name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "unknown dtype {s:?}: expected one of {}",
                    DType::ALL.map(|d| d.name()).join(", ")
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_names() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert_eq!(DType::from_safetensors_name(d.safetensors_name()), Some(d));
        }
        assert_eq!("BF16".parse::<DType>().unwrap(), DType::Bf16);
        assert!("f128".parse::<DType>().is_err());
    }
}
