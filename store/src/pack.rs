//! Packs: many small chunk objects in one stored object, so a checkpoint of biases and norms
//! costs a few puts, not one per tensor.
//!
//! ```text
//! offset  size  field
//! 0       4     magic "CKPK"
//! 4       1     format version (1)
//! 5       3     reserved
//! 8       4     number of entries, u32 LE
//! 12      4     reserved
//! 16      8     offset of the index, u64 LE
//! 24      8     reserved
//! 32      ..    chunk objects back to back (each with its own chunk header)
//! index   48 x entries: chunk id (32), offset u64, stored length u32, raw length u32
//! ```
//!
//! A chunk in a pack is read with one range request (`offset .. offset + stored`); the index
//! lets `verify` and `gc` see what a pack holds without any manifest. The pack id is the blake3
//! hash of the whole object.

use bytes::{BufMut, Bytes, BytesMut};

use crate::codec::Encoded;
use crate::error::{Error, Result};
use crate::id::{ChunkId, PackId};

/// Magic of pack objects.
pub const PACK_MAGIC: [u8; 4] = *b"CKPK";
/// Pack format version.
pub const PACK_FORMAT: u8 = 1;
/// Bytes of the pack header.
pub const PACK_HEADER_LEN: usize = 32;
const ENTRY_LEN: usize = 48;

/// One chunk inside a pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackEntry {
    /// The chunk.
    pub id: ChunkId,
    /// Offset of its chunk object in the pack.
    pub offset: u64,
    /// Length of its chunk object.
    pub stored: u32,
    /// Raw length of the chunk.
    pub raw: u32,
}

/// Collects encoded small chunks into one pack object.
#[derive(Debug, Default)]
pub struct PackBuilder {
    entries: Vec<PackEntry>,
    body: Vec<Bytes>,
    len: u64,
}

impl PackBuilder {
    /// An empty pack.
    pub fn new() -> Self {
        PackBuilder {
            entries: Vec::new(),
            body: Vec::new(),
            len: PACK_HEADER_LEN as u64,
        }
    }

    /// Append an encoded chunk; returns its offset in the pack.
    pub fn add(&mut self, id: ChunkId, raw_len: u32, enc: Encoded) -> u64 {
        let offset = self.len;
        let stored = enc.len() as u32;
        self.entries.push(PackEntry {
            id,
            offset,
            stored,
            raw: raw_len,
        });
        self.len += stored as u64;
        self.body.extend(enc.parts);
        offset
    }

    /// Bytes so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// No chunks yet.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Finish the pack: its id, entries and the object's pieces.
    pub fn seal(self) -> (PackId, Vec<PackEntry>, Vec<Bytes>) {
        let mut head = BytesMut::with_capacity(PACK_HEADER_LEN);
        head.put_slice(&PACK_MAGIC);
        head.put_u8(PACK_FORMAT);
        head.put_bytes(0, 3);
        head.put_u32_le(self.entries.len() as u32);
        head.put_u32_le(0);
        head.put_u64_le(self.len);
        head.put_u64_le(0);
        let mut index = BytesMut::with_capacity(self.entries.len() * ENTRY_LEN);
        for e in &self.entries {
            index.put_slice(&e.id.0.0);
            index.put_u64_le(e.offset);
            index.put_u32_le(e.stored);
            index.put_u32_le(e.raw);
        }
        let mut parts = Vec::with_capacity(self.body.len() + 2);
        parts.push(head.freeze());
        parts.extend(self.body);
        parts.push(index.freeze());
        let mut h = blake3::Hasher::new();
        for p in &parts {
            h.update(p);
        }
        let id = PackId(crate::id::Hash(*h.finalize().as_bytes()));
        (id, self.entries, parts)
    }
}

/// Parse a whole pack object's index. `what` names the object in messages.
pub fn parse_pack(obj: &[u8], what: &dyn std::fmt::Display) -> Result<Vec<PackEntry>> {
    let corrupt = |m: String| Error::corrupt(format!("{what}: {m}"));
    if obj.len() < PACK_HEADER_LEN {
        return Err(corrupt(format!(
            "{} bytes is too short for a pack (truncated?)",
            obj.len()
        )));
    }
    if obj[..4] != PACK_MAGIC {
        return Err(corrupt("not a pack object (bad magic)".into()));
    }
    if obj[4] != PACK_FORMAT {
        return Err(corrupt(format!("pack format {} is not supported", obj[4])));
    }
    let n = u32::from_le_bytes(obj[8..12].try_into().expect("4 bytes")) as usize;
    let index_at = u64::from_le_bytes(obj[16..24].try_into().expect("8 bytes"));
    let want = (index_at as u128) + (n as u128) * ENTRY_LEN as u128;
    if index_at < PACK_HEADER_LEN as u64 || want != obj.len() as u128 {
        return Err(corrupt(format!(
            "index of {n} entries at {index_at} does not end at the object's end ({} bytes; truncated?)",
            obj.len()
        )));
    }
    let mut out = Vec::with_capacity(n);
    for e in obj[index_at as usize..].chunks_exact(ENTRY_LEN) {
        let entry = PackEntry {
            id: ChunkId(crate::id::Hash(e[..32].try_into().expect("32 bytes"))),
            offset: u64::from_le_bytes(e[32..40].try_into().expect("8 bytes")),
            stored: u32::from_le_bytes(e[40..44].try_into().expect("4 bytes")),
            raw: u32::from_le_bytes(e[44..48].try_into().expect("4 bytes")),
        };
        let end = entry.offset.checked_add(entry.stored as u64);
        if entry.offset < PACK_HEADER_LEN as u64 || end.is_none_or(|e| e > index_at) {
            return Err(corrupt(format!(
                "entry for {} points outside the pack body",
                entry.id
            )));
        }
        out.push(entry);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{self, CodecPolicy};

    #[test]
    fn pack_round_trip() {
        let mut b = PackBuilder::new();
        let datas: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 100 + i as usize * 1000]).collect();
        for d in &datas {
            let enc = codec::encode(&Bytes::from(d.clone()), 1, CodecPolicy::FAST);
            b.add(ChunkId::of(d), d.len() as u32, enc);
        }
        let (id, entries, parts) = b.seal();
        let obj: Vec<u8> = parts.concat();
        assert_eq!(id, PackId::of(&obj));
        assert_eq!(parse_pack(&obj, &"p").unwrap(), entries);
        for (e, d) in entries.iter().zip(&datas) {
            let slice = &obj[e.offset as usize..(e.offset + e.stored as u64) as usize];
            assert_eq!(codec::decode(slice, &e.id, e.raw as u64, &"c").unwrap(), *d);
        }
        let e = parse_pack(&obj[..obj.len() - 3], &"pack P").unwrap_err();
        assert!(e.to_string().starts_with("pack P:"), "{e}");
    }
}
