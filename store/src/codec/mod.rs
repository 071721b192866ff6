//! Chunk objects: a 16-byte header and a payload in one of four codecs.
//!
//! ```text
//! offset  size  field
//! 0       4     magic "CKPC"
//! 4       1     format version (1; 2 for delta objects)
//! 5       1     codec: 0 raw, 1 zstd, 2 byte planes, 3 delta
//! 6       1     element size for byte planes (1, 2, 4, 8), else 0
//! 7       1     transform: 0 none, 1 elements rotated left by one bit (byte planes)
//! 8       8     raw length, u64 little-endian
//! 16      ..    payload
//! ```
//!
//! The byte-plane payload splits each element's bytes into separate planes (plane `k` holds
//! byte `k` of every element, little-endian, so the last plane holds the sign and exponent of
//! floats) and stores each plane raw or zstd-compressed:
//!
//! ```text
//! u8 planes; planes x { u8 kind (0 raw, 1 zstd); u32 stored length }; plane payloads
//! ```
//!
//! A delta object (codec 3, format 2) holds a chunk as the difference to a *base* chunk (the
//! same region of an earlier committed step): its payload is the base's chunk id (32 bytes)
//! and then a byte-plane payload, as above, of `plain XOR base plain`. Decoding needs the
//! base's plain bytes ([`decode_delta`], a whole chain at once: [`decode_chain`]); the chunk id
//! stays the hash of the plain bytes.
//!
//! The codec is chosen per chunk by measuring a sample: a plane (or chunk) is compressed only
//! when the sample shows it pays. Decoding checks the blake3 hash of the result and refuses
//! lengths that no writer produces, before allocating anything.

use std::cell::RefCell;

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::id::ChunkId;

mod delta;
mod into;
mod planes;
#[cfg(test)]
mod tests;

pub use delta::{
    DELTA_MARGIN_TENTHS, DeltaEstimate, check_delta_structure, decode_delta, delta_base,
    encode_delta, estimate_delta,
};
pub use into::{decode_chain, decode_into};
use planes::xor_planes_into;
pub use planes::{join_planes, split_planes};

/// Magic of chunk objects.
pub const CHUNK_MAGIC: [u8; 4] = *b"CKPC";
/// Chunk format version this build writes for raw, zstd and byte-plane objects.
pub const CHUNK_FORMAT: u8 = 1;
/// Chunk format version of delta objects (the newest this build reads).
pub const CHUNK_FORMAT_DELTA: u8 = 2;
/// Bytes of the chunk header.
pub const HEADER_LEN: usize = 16;
/// The largest raw chunk any writer produces (chunk sizes are capped at this). A header
/// claiming more is damaged or hostile and is refused before any allocation.
pub const MAX_CHUNK_LEN: u64 = 256 << 20;

/// Bytes sampled from each plane to decide whether compressing it pays.
const SAMPLE: usize = 64 << 10;

/// How a chunk's payload is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    /// Stored as is.
    Raw,
    /// One zstd frame.
    Zstd,
    /// Byte planes, each raw or zstd.
    Planes,
    /// Byte planes of the XOR with a base chunk (see the module docs).
    Delta,
}

impl Codec {
    fn tag(self) -> u8 {
        match self {
            Codec::Raw => 0,
            Codec::Zstd => 1,
            Codec::Planes => 2,
            Codec::Delta => 3,
        }
    }
    fn from_tag(t: u8) -> Option<Codec> {
        match t {
            0 => Some(Codec::Raw),
            1 => Some(Codec::Zstd),
            2 => Some(Codec::Planes),
            3 => Some(Codec::Delta),
            _ => None,
        }
    }
    /// Lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            Codec::Raw => "raw",
            Codec::Zstd => "zstd",
            Codec::Planes => "planes",
            Codec::Delta => "delta",
        }
    }
}

/// How hard the writer tries to compress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "mode")]
pub enum CodecPolicy {
    /// Never compress.
    Raw,
    /// zstd at `level` on what a sample shows pays at least `min_saving` (in 1/1000 of the
    /// sample), byte planes for floating point data.
    Compress {
        /// zstd level (1 is fast; 3 is zstd's default).
        level: i32,
        /// The least saving (per mille of the sample) worth compressing for.
        min_saving_permille: u16,
    },
}

impl CodecPolicy {
    /// Fast: zstd-1 where it saves at least 5 %; suits local disks.
    pub const FAST: CodecPolicy = CodecPolicy::Compress {
        level: 1,
        min_saving_permille: 50,
    };
    /// Thorough: zstd-1 wherever it saves at least 2 %; suits slow sinks (object stores).
    /// (zstd-3 compresses byte planes of weights and moments *worse* than zstd-1, by 0.01 to
    /// 0.02 of raw, and 30-50 % slower: BENCHMARKS.md.)
    pub const MAX: CodecPolicy = CodecPolicy::Compress {
        level: 1,
        min_saving_permille: 20,
    };
}

/// A parsed chunk header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Codec of the payload.
    pub codec: Codec,
    /// Element size for byte planes.
    pub elem: u8,
    /// Byte planes of elements rotated left by one bit (1) or as they are (0).
    pub rotated: bool,
    /// Raw length.
    pub raw_len: u64,
}

/// An encoded chunk object, as pieces to write back to back.
#[derive(Debug, Clone)]
pub struct Encoded {
    /// The chosen codec.
    pub codec: Codec,
    /// Header, then payload pieces (the raw codec reuses the caller's buffer, no copy).
    pub parts: Vec<Bytes>,
}

impl Encoded {
    /// Bytes of the whole object.
    pub fn len(&self) -> usize {
        self.parts.iter().map(Bytes::len).sum()
    }

    /// Whether the object is empty (never: there is always a header).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The object as one buffer (copies unless it is a single piece).
    pub fn to_bytes(&self) -> Bytes {
        if self.parts.len() == 1 {
            return self.parts[0].clone();
        }
        let mut b = BytesMut::with_capacity(self.len());
        for p in &self.parts {
            b.extend_from_slice(p);
        }
        b.freeze()
    }
}

fn header(codec: Codec, elem: u8, raw_len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&CHUNK_MAGIC);
    h[4] = if codec == Codec::Delta {
        CHUNK_FORMAT_DELTA
    } else {
        CHUNK_FORMAT
    };
    h[5] = codec.tag();
    h[6] = elem;
    // Byte planes are always written rotated (see `split_planes`).
    h[7] = u8::from(matches!(codec, Codec::Planes | Codec::Delta));
    h[8..16].copy_from_slice(&raw_len.to_le_bytes());
    h
}

thread_local! {
    static COMPRESSOR: RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> = const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

fn compress(data: &[u8], level: i32) -> Vec<u8> {
    COMPRESSOR.with(|c| {
        let mut c = c.borrow_mut();
        if c.as_ref().map(|(l, _)| *l) != Some(level) {
            let comp = zstd::bulk::Compressor::new(level).expect("zstd compressor");
            *c = Some((level, comp));
        }
        let (_, comp) = c.as_mut().expect("set above");
        comp.compress(data)
            .expect("zstd compress into a growable buffer")
    })
}

/// Decompress the zstd frame `src` into `dst` (a slice, or a `Vec` written into its spare
/// capacity, so a fresh buffer is not zeroed first), which must then hold exactly `want` bytes.
fn decompress_to<W: zstd::zstd_safe::WriteBuf + ?Sized>(
    src: &[u8],
    dst: &mut W,
    want: usize,
) -> std::result::Result<(), String> {
    DECOMPRESSOR.with(|d| {
        let mut d = d.borrow_mut();
        if d.is_none() {
            *d = Some(zstd::bulk::Decompressor::new().map_err(|e| e.to_string())?);
        }
        let dec = d.as_mut().expect("set above");
        let n = dec
            .decompress_to_buffer(src, dst)
            .map_err(|e| format!("zstd: {e}"))?;
        if n != want {
            return Err(format!("zstd frame holds {n} bytes, expected {want}"));
        }
        Ok(())
    })
}

fn decompress_into(src: &[u8], dst: &mut [u8]) -> std::result::Result<(), String> {
    let want = dst.len();
    decompress_to(src, dst, want)
}

fn sample_pays(data: &[u8], level: i32, min_saving_permille: u16) -> bool {
    if data.len() < 64 {
        return false;
    }
    // Sample from the middle too: tensors often start with structured rows.
    let sample: Vec<u8>;
    let s: &[u8] = if data.len() <= SAMPLE {
        data
    } else {
        let half = SAMPLE / 2;
        let mid = data.len() / 2;
        sample = [&data[..half], &data[mid..mid + half]].concat();
        &sample
    };
    saves(compress(s, level).len(), s.len(), min_saving_permille)
}

/// Whether `compressed` bytes of `len` save at least `min_saving_permille`.
fn saves(compressed: usize, len: usize, min_saving_permille: u16) -> bool {
    (compressed as u64) * 1000 <= (len as u64) * (1000 - min_saving_permille as u64)
}

/// One byte plane as the encoder stores it: zstd at `level` where that saves at least
/// `min_saving_permille` (judged on a sample of a plane larger than one) and is smaller, else
/// raw. The plane's kind in the table (0 raw, 1 zstd) and its bytes.
fn encode_plane(p: Vec<u8>, level: i32, min_saving_permille: u16) -> (u8, Bytes) {
    let c = if p.len() < 64 {
        None
    } else if p.len() <= SAMPLE {
        // The plane is its own sample: compressed once.
        Some(compress(&p, level)).filter(|c| saves(c.len(), p.len(), min_saving_permille))
    } else if sample_pays(&p, level, min_saving_permille) {
        Some(compress(&p, level))
    } else {
        None
    };
    match c {
        Some(c) if c.len() < p.len() => (1, Bytes::from(c)),
        _ => (0, Bytes::from(p)),
    }
}

/// Encode one chunk. `elem` is the element size of floating-point data (2, 4 or 8) for byte
/// planes, or 1 for anything else.
pub fn encode(data: &Bytes, elem: usize, policy: CodecPolicy) -> Encoded {
    let raw = || Encoded {
        codec: Codec::Raw,
        parts: vec![
            Bytes::copy_from_slice(&header(Codec::Raw, 0, data.len() as u64)),
            data.clone(),
        ],
    };
    let CodecPolicy::Compress {
        level,
        min_saving_permille,
    } = policy
    else {
        return raw();
    };
    if data.len() < 256 {
        return raw();
    }
    if matches!(elem, 2 | 4 | 8) && data.len().is_multiple_of(elem) {
        let Some(mut body) = planes_payload(data, elem, level, min_saving_permille, false) else {
            return raw();
        };
        let mut parts = vec![Bytes::copy_from_slice(&header(
            Codec::Planes,
            elem as u8,
            data.len() as u64,
        ))];
        parts.append(&mut body);
        let enc = Encoded {
            codec: Codec::Planes,
            parts,
        };
        return if enc.len() < data.len() + HEADER_LEN {
            enc
        } else {
            raw()
        };
    }
    if sample_pays(data, level, min_saving_permille) {
        let c = compress(data, level);
        if c.len() < data.len() {
            return Encoded {
                codec: Codec::Zstd,
                parts: vec![
                    Bytes::copy_from_slice(&header(Codec::Zstd, 0, data.len() as u64)),
                    Bytes::from(c),
                ],
            };
        }
    }
    raw()
}

/// The byte-plane payload of `data` (table, then planes): `None` when no plane compresses and
/// `force` is off.
fn planes_payload(
    data: &[u8],
    elem: usize,
    level: i32,
    min_saving_permille: u16,
    force: bool,
) -> Option<Vec<Bytes>> {
    let planes = split_planes(data, elem, true);
    let mut table = Vec::with_capacity(elem);
    let mut payload: Vec<Bytes> = Vec::with_capacity(elem + 1);
    let mut any = false;
    for p in planes {
        let (kind, b) = encode_plane(p, level, min_saving_permille);
        any |= kind == 1;
        table.push((kind, b.len() as u32));
        payload.push(b);
    }
    if !any && !force {
        return None;
    }
    let mut head = BytesMut::with_capacity(1 + 5 * elem);
    head.put_u8(elem as u8);
    for (kind, len) in &table {
        head.put_u8(*kind);
        head.put_u32_le(*len);
    }
    payload.insert(0, head.freeze());
    Some(payload)
}

/// Parse and check a chunk header. `what` names the object in messages.
pub fn parse_header(obj: &[u8], what: &dyn std::fmt::Display) -> Result<Header> {
    if obj.len() < HEADER_LEN {
        return Err(Error::corrupt(format!(
            "{what}: {} bytes is too short for a chunk object (truncated?)",
            obj.len()
        )));
    }
    if obj[..4] != CHUNK_MAGIC {
        return Err(Error::corrupt(format!(
            "{what}: not a chunk object (bad magic {:02x?})",
            &obj[..4]
        )));
    }
    if obj[4] != CHUNK_FORMAT && obj[4] != CHUNK_FORMAT_DELTA {
        return Err(Error::corrupt(format!(
            "{what}: chunk format {} is not supported (this build reads {CHUNK_FORMAT} and {CHUNK_FORMAT_DELTA})",
            obj[4]
        )));
    }
    let codec = Codec::from_tag(obj[5])
        .ok_or_else(|| Error::corrupt(format!("{what}: unknown codec tag {}", obj[5])))?;
    if (codec == Codec::Delta) != (obj[4] == CHUNK_FORMAT_DELTA) {
        return Err(Error::corrupt(format!(
            "{what}: codec {} in a chunk object of format {}",
            codec.name(),
            obj[4]
        )));
    }
    let raw_len = u64::from_le_bytes(obj[8..16].try_into().expect("8 bytes"));
    if raw_len > MAX_CHUNK_LEN {
        return Err(Error::corrupt(format!(
            "{what}: header claims {raw_len} bytes, more than any chunk ckpt writes ({MAX_CHUNK_LEN}); refusing to decode"
        )));
    }
    if obj[7] > 1 || (obj[7] == 1 && !matches!(codec, Codec::Planes | Codec::Delta)) {
        return Err(Error::corrupt(format!(
            "{what}: unknown transform {} for codec {}",
            obj[7],
            codec.name()
        )));
    }
    Ok(Header {
        codec,
        elem: obj[6],
        rotated: obj[7] == 1,
        raw_len,
    })
}

/// Decode a chunk object and check it against `id` (blake3 of the raw bytes) and the expected
/// raw length. `what` names the object in messages.
pub fn decode(
    obj: &[u8],
    id: &ChunkId,
    expect_len: u64,
    what: &dyn std::fmt::Display,
) -> Result<Vec<u8>> {
    let h = parse_header(obj, what)?;
    check_len(&h, expect_len, what)?;
    let mut out = vec![0u8; h.raw_len as usize];
    let plain = into::plain_of(obj, &h, what, &mut out)?;
    check_id_of(into::write_hashed(&plain, None, &mut out), id, what)?;
    Ok(out)
}

/// [`decode`] of an object held as [`Bytes`]: a raw chunk is returned as a slice of it (no
/// copy), anything else decoded.
pub fn decode_bytes(
    obj: Bytes,
    id: &ChunkId,
    expect_len: u64,
    what: &dyn std::fmt::Display,
) -> Result<Bytes> {
    match raw_payload(&obj, expect_len, what)? {
        Some(payload) => {
            check_id(&payload, id, what)?;
            Ok(payload)
        }
        None => decode(&obj, id, expect_len, what).map(Bytes::from),
    }
}

/// The payload of a chunk object stored raw, its header and length checked but **not its
/// hash**: for a reader that hashes the bytes as it copies them out
/// ([`check_id_of`] with the hash it computed), one pass over memory instead of two. `None`:
/// the object is encoded (decode it with [`decode_bytes`]).
pub fn raw_payload(
    obj: &Bytes,
    expect_len: u64,
    what: &dyn std::fmt::Display,
) -> Result<Option<Bytes>> {
    let h = parse_header(obj, what)?;
    if h.codec != Codec::Raw {
        return Ok(None);
    }
    check_len(&h, expect_len, what)?;
    let payload = obj.slice(HEADER_LEN..);
    if payload.len() as u64 != h.raw_len {
        return Err(Error::corrupt(format!(
            "{what}: raw payload holds {} bytes, header says {} (truncated?)",
            payload.len(),
            h.raw_len
        )));
    }
    Ok(Some(payload))
}

/// Check that `got`, the hash of a chunk's plain bytes computed by the caller, is `id`: the
/// same refusal, in the same words, as every other read's check.
pub fn check_id_of(got: ChunkId, id: &ChunkId, what: &dyn std::fmt::Display) -> Result<()> {
    if got != *id {
        return Err(Error::corrupt(format!(
            "{what}: content hash is {} but should be {} (the bytes are damaged)",
            got.short(),
            id.short()
        )));
    }
    Ok(())
}

fn check_len(h: &Header, expect_len: u64, what: &dyn std::fmt::Display) -> Result<()> {
    if h.raw_len != expect_len {
        return Err(Error::corrupt(format!(
            "{what}: header says {} bytes but the manifest expects {expect_len}",
            h.raw_len
        )));
    }
    Ok(())
}

fn check_id(plain: &[u8], id: &ChunkId, what: &dyn std::fmt::Display) -> Result<()> {
    check_id_of(ChunkId::of(plain), id, what)
}

/// Decode a chunk object whose id is known but whose length is not (verifying the whole
/// store): the length comes from the header, already bounded by [`MAX_CHUNK_LEN`].
pub fn decode_verify(obj: &[u8], id: &ChunkId, what: &dyn std::fmt::Display) -> Result<Vec<u8>> {
    let h = parse_header(obj, what)?;
    decode(obj, id, h.raw_len, what)
}

/// Decode a byte-plane payload (table, then planes) into `h.raw_len` bytes.
fn decode_planes(payload: &[u8], h: &Header, what: &dyn std::fmt::Display) -> Result<Vec<u8>> {
    let mut out = vec![0u8; h.raw_len as usize];
    decode_planes_into(payload, h, what, &mut out, false)?;
    Ok(out)
}

/// Decode a byte-plane payload into `out` (`h.raw_len` bytes), stored or, with `xor`, XORed
/// into what `out` holds.
fn decode_planes_into(
    payload: &[u8],
    h: &Header,
    what: &dyn std::fmt::Display,
    out: &mut [u8],
    xor: bool,
) -> Result<()> {
    let planes = plane_payload(payload, h, what)?;
    if out.len() != h.raw_len as usize {
        return Err(Error::corrupt(format!(
            "{what}: byte planes of {} bytes for {} bytes",
            h.raw_len,
            out.len()
        )));
    }
    let refs: Vec<&[u8]> = planes.iter().map(AsRef::as_ref).collect();
    if xor {
        xor_planes_into(&refs, out, h.rotated);
    } else {
        join_planes(&refs, out, h.rotated);
    }
    Ok(())
}

/// The byte planes of a byte-plane payload (table, then planes), checked against the header:
/// raw planes where they lie, compressed ones decompressed.
fn plane_payload<'a>(
    payload: &'a [u8],
    h: &Header,
    what: &dyn std::fmt::Display,
) -> Result<Vec<std::borrow::Cow<'a, [u8]>>> {
    let raw_len = h.raw_len as usize;
    let corrupt = |m: String| Error::corrupt(format!("{what}: {m}"));
    let elem = h.elem as usize;
    if !matches!(elem, 2 | 4 | 8) || !raw_len.is_multiple_of(elem) {
        return Err(corrupt(format!(
            "byte planes of {elem}-byte elements cannot make {raw_len} bytes"
        )));
    }
    if payload.is_empty() || payload[0] as usize != elem {
        return Err(corrupt("byte-plane table is damaged".into()));
    }
    let table_len = 1 + 5 * elem;
    if payload.len() < table_len {
        return Err(corrupt("byte-plane table is truncated".into()));
    }
    let n = raw_len / elem;
    let mut pos = table_len;
    // Raw planes are read where they lie; compressed ones are decompressed.
    let mut planes: Vec<std::borrow::Cow<'_, [u8]>> = Vec::with_capacity(elem);
    for k in 0..elem {
        let e = &payload[1 + 5 * k..1 + 5 * (k + 1)];
        let kind = e[0];
        let len = u32::from_le_bytes(e[1..5].try_into().expect("4 bytes")) as usize;
        let Some(src) = payload.get(pos..pos.saturating_add(len)) else {
            return Err(corrupt(format!("byte plane {k} is truncated")));
        };
        pos += len;
        let plane = match kind {
            0 if len == n => std::borrow::Cow::Borrowed(src),
            0 => {
                return Err(corrupt(format!(
                    "raw byte plane {k} holds {len} bytes, expected {n}"
                )));
            }
            1 => {
                let mut p = Vec::with_capacity(n);
                decompress_to(src, &mut p, n)
                    .map_err(|m| corrupt(format!("byte plane {k}: {m}")))?;
                std::borrow::Cow::Owned(p)
            }
            other => return Err(corrupt(format!("byte plane {k}: unknown kind {other}"))),
        };
        planes.push(plane);
    }
    if pos != payload.len() {
        return Err(corrupt(format!(
            "{} trailing bytes after the byte planes",
            payload.len() - pos
        )));
    }
    Ok(planes)
}
