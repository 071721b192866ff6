//! Typed identifiers over one blake3 hash type.
//!
//! Every persisted thing that is addressed by content has its own id type, so a chunk id can
//! never be passed where a pack id is expected. The mapping from ids to object keys lives in
//! [`crate::keys`] and nowhere else.

use std::fmt;
use std::str::FromStr;

use parking_lot::Mutex;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};

/// Data shorter than this is hashed without looking for zeros first.
const ZERO_MIN: usize = 64 << 10;

/// Lengths of zeros whose hash is remembered ([`zero_hash`]): a save's chunks have one size
/// and a tail per tensor.
const ZERO_LENGTHS: usize = 16;

/// Whether `data` is all zeros; stops at the first block that is not.
fn is_zero(data: &[u8]) -> bool {
    data.chunks(4096)
        .all(|b| b.iter().fold(0u8, |acc, &x| acc | x) == 0)
}

/// The hash of `zeros` (all zero bytes): remembered by length, the lengths used last kept.
fn zero_hash(zeros: &[u8]) -> Hash {
    static KNOWN: Mutex<Vec<(usize, Hash)>> = Mutex::new(Vec::new());
    let n = zeros.len();
    let used = |known: &mut Vec<(usize, Hash)>| {
        let i = known.iter().position(|(l, _)| *l == n)?;
        let e = known.remove(i);
        known.push(e);
        Some(e.1)
    };
    if let Some(h) = used(&mut KNOWN.lock()) {
        return h;
    }
    let h = Hash(*blake3::hash(zeros).as_bytes());
    let mut known = KNOWN.lock();
    // Another thread may have hashed the same length meanwhile.
    if used(&mut known).is_none() {
        if known.len() == ZERO_LENGTHS {
            known.remove(0);
        }
        known.push((n, h));
    }
    h
}

/// A blake3 hash (32 bytes). Shown and serialized as 64 lowercase hex characters.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Hash(pub [u8; 32]);

impl Hash {
    /// Hash `data` with blake3 on the calling thread. Long runs of zeros (the moments of frozen
    /// layers, zero-initialised buffers, padding) are common in a training state: their hash
    /// is remembered by length, so such data costs one read of memory, not a hash.
    pub fn of(data: &[u8]) -> Self {
        if data.len() >= ZERO_MIN && is_zero(data) {
            return zero_hash(data);
        }
        Hash(*blake3::hash(data).as_bytes())
    }

    /// Lowercase hex.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push(HEX[(b >> 4) as usize] as char);
            s.push(HEX[(b & 15) as usize] as char);
        }
        s
    }

    /// Parse 64 hex characters.
    pub fn from_hex(s: &str) -> Result<Self> {
        let b = s.as_bytes();
        if b.len() != 64 {
            return Err(Error::invalid(format!(
                "'{s}' is not a blake3 hash: expected 64 hex characters, found {}",
                b.len()
            )));
        }
        let mut out = [0u8; 32];
        for (i, pair) in b.chunks_exact(2).enumerate() {
            let hi = hex_val(pair[0]);
            let lo = hex_val(pair[1]);
            match (hi, lo) {
                (Some(h), Some(l)) => out[i] = (h << 4) | l,
                _ => {
                    return Err(Error::invalid(format!(
                        "'{s}' is not a blake3 hash: non-hex character"
                    )));
                }
            }
        }
        Ok(Hash(out))
    }

    /// The first 12 hex characters, for humans.
    pub fn short(&self) -> String {
        self.to_hex()[..12].to_string()
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

impl fmt::Debug for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.short())
    }
}

impl fmt::Display for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl Serialize for Hash {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for Hash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Hash::from_hex(&s).map_err(serde::de::Error::custom)
    }
}

macro_rules! define_id {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub Hash);

        impl $name {
            /// What this id names, for messages.
            pub const KIND: &'static str = $kind;

            /// The id of `data` (blake3 of the bytes).
            pub fn of(data: &[u8]) -> Self {
                $name(Hash::of(data))
            }

            /// Lowercase hex of the hash.
            pub fn to_hex(&self) -> String {
                self.0.to_hex()
            }

            /// The first 12 hex characters, for humans.
            pub fn short(&self) -> String {
                self.0.short()
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}:{}", $kind, self.0.short())
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{} {}", $kind, self.0.to_hex())
            }
        }

        impl FromStr for $name {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self> {
                Hash::from_hex(s).map($name)
            }
        }
    };
}

define_id!(
    /// A chunk: blake3 of the chunk's raw (decoded) bytes.
    ChunkId,
    "chunk"
);
define_id!(
    /// A pack of small chunks: blake3 of the pack object's bytes.
    PackId,
    "pack"
);
define_id!(
    /// A committed checkpoint: blake3 of its commit record's bytes.
    StepId,
    "step"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let h = Hash::of(b"hello");
        assert_eq!(h.to_hex(), blake3::hash(b"hello").to_hex().as_str());
        assert_eq!(Hash::from_hex(&h.to_hex()).unwrap(), h);
        assert_eq!(Hash::from_hex(&h.to_hex().to_uppercase()).unwrap(), h);
    }

    #[test]
    fn zeros_hash_as_blake3_of_zeros_at_every_length() {
        for n in [0, 1, ZERO_MIN - 1, ZERO_MIN, ZERO_MIN + 1, 4 << 20, 3 << 20] {
            let zeros = vec![0u8; n];
            let want = Hash(*blake3::hash(&zeros).as_bytes());
            assert!(is_zero(&zeros));
            // Twice: the second comes from what the first remembered.
            assert_eq!(Hash::of(&zeros), want, "{n} zeros");
            assert_eq!(Hash::of(&zeros), want, "{n} zeros, remembered");
        }
        // More lengths than are remembered, then the first again.
        for n in 0..2 * ZERO_LENGTHS {
            let zeros = vec![0u8; ZERO_MIN + n];
            assert_eq!(Hash::of(&zeros), Hash(*blake3::hash(&zeros).as_bytes()));
        }
        // One byte set anywhere (the first, the last, inside a later block) is not zeros.
        for at in [0, 4095, 4096, ZERO_MIN, (4 << 20) - 1] {
            let mut d = vec![0u8; 4 << 20];
            d[at] = 1;
            assert_eq!(
                Hash::of(&d),
                Hash(*blake3::hash(&d).as_bytes()),
                "byte {at}"
            );
            assert!(!is_zero(&d), "byte {at}");
        }
    }

    #[test]
    fn bad_hex_is_refused_with_reason() {
        let e = Hash::from_hex("abc").unwrap_err().to_string();
        assert!(e.contains("expected 64 hex characters"), "{e}");
        let e = Hash::from_hex(&"g".repeat(64)).unwrap_err().to_string();
        assert!(e.contains("non-hex"), "{e}");
    }

    #[test]
    fn ids_serialize_as_hex_strings() {
        let id = ChunkId::of(b"x");
        let j = serde_json::to_string(&id).unwrap();
        assert_eq!(j, format!("\"{}\"", id.to_hex()));
        let back: ChunkId = serde_json::from_str(&j).unwrap();
        assert_eq!(back, id);
        assert!(format!("{id:?}").starts_with("chunk:"));
    }
}
