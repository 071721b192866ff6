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

fn decompress_into(src: &[u8], dst: &mut [u8]) -> std::result::Result<(), String> {
    DECOMPRESSOR.with(|d| {
        let mut d = d.borrow_mut();
        if d.is_none() {
            *d = Some(zstd::bulk::Decompressor::new().map_err(|e| e.to_string())?);
        }
        let dec = d.as_mut().expect("set above");
        let n = dec
            .decompress_to_buffer(src, dst)
            .map_err(|e| format!("zstd: {e}"))?;
        if n != dst.len() {
            return Err(format!(
                "zstd frame holds {n} bytes, expected {}",
                dst.len()
            ));
        }
        Ok(())
    })
}

/// Whether compressing `data` at `level` is worth it, judged on a sample.
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

/// What [`encode_delta`] and [`estimate_delta`] need: a base of the data's length and whole
/// float elements (a caller's bug otherwise).
fn check_delta_args(data: &[u8], base: &[u8], elem: usize) {
    assert_eq!(
        data.len(),
        base.len(),
        "a delta needs a base of the same length"
    );
    assert!(
        matches!(elem, 2 | 4 | 8) && data.len().is_multiple_of(elem),
        "a delta needs whole float elements"
    );
}

/// The XOR of `data` and `base` (the same length): what a delta object encodes.
fn xor(data: &[u8], base: &[u8]) -> Vec<u8> {
    data.iter().zip(base).map(|(a, b)| a ^ b).collect()
}

/// Split `data` (elements of `elem` bytes, little-endian) into byte planes. With `rotate`,
/// each element is first rotated left by one bit, which moves the sign bit of a float to the
/// lowest plane and its whole exponent into the highest one (bf16 and fp32: exactly the
/// exponent byte), where it compresses best.
pub fn split_planes(data: &[u8], elem: usize, rotate: bool) -> Vec<Vec<u8>> {
    let n = data.len() / elem;
    let mut planes: Vec<Vec<u8>> = (0..elem).map(|_| vec![0u8; n]).collect();
    let mut refs: Vec<&mut [u8]> = planes.iter_mut().map(Vec::as_mut_slice).collect();
    match (elem, rotate) {
        (2, true) => split_words::<u16, 1>(data, &mut refs),
        (2, false) => split_words::<u16, 0>(data, &mut refs),
        (4, true) => split_words::<u32, 1>(data, &mut refs),
        (4, false) => split_words::<u32, 0>(data, &mut refs),
        (8, true) => split_words::<u64, 1>(data, &mut refs),
        (8, false) => split_words::<u64, 0>(data, &mut refs),
        _ => {
            for (i, c) in data.chunks_exact(elem).enumerate() {
                for (k, byte) in c.iter().enumerate() {
                    refs[k][i] = *byte;
                }
            }
        }
    }
    planes
}

/// Interleave byte planes back into `out` (the inverse of [`split_planes`]).
pub fn join_planes(planes: &[&[u8]], out: &mut [u8], rotated: bool) {
    join_planes_as::<false>(planes, out, rotated);
}

/// [`join_planes`] XORed into `out` instead of stored: applies a delta's planes to its base
/// in one pass.
fn xor_planes_into(planes: &[&[u8]], out: &mut [u8], rotated: bool) {
    join_planes_as::<true>(planes, out, rotated);
}

fn join_planes_as<const XOR: bool>(planes: &[&[u8]], out: &mut [u8], rotated: bool) {
    let elem = planes.len();
    match (elem, rotated) {
        (2, true) => join_words::<u16, 1, XOR>(planes, out),
        (2, false) => join_words::<u16, 0, XOR>(planes, out),
        (4, true) => join_words::<u32, 1, XOR>(planes, out),
        (4, false) => join_words::<u32, 0, XOR>(planes, out),
        (8, true) => join_words::<u64, 1, XOR>(planes, out),
        (8, false) => join_words::<u64, 0, XOR>(planes, out),
        _ => {
            for (i, c) in out.chunks_exact_mut(elem).enumerate() {
                for (k, byte) in c.iter_mut().enumerate() {
                    *byte = if XOR {
                        *byte ^ planes[k][i]
                    } else {
                        planes[k][i]
                    };
                }
            }
        }
    }
}

/// Elements a plane kernel moves per block: a fixed-size block lets the compiler drop the
/// bounds checks and vectorize (8 GB/s for fp32 on this machine's CPU, 0.6-2.8 GB/s for the
/// element-at-a-time loop it replaces, which was a restore's bottleneck).
const PLANE_BLOCK: usize = 64;

/// An element as an integer word of 2, 4 or 8 bytes, for the byte-plane kernels.
trait Word:
    Copy
    + Default
    + std::ops::BitOr<Output = Self>
    + std::ops::BitXor<Output = Self>
    + std::ops::Shl<u32, Output = Self>
    + std::ops::Shr<u32, Output = Self>
{
    const BYTES: usize;
    fn from_byte(b: u8) -> Self;
    fn low_byte(self) -> u8;
    fn rotate_right(self, r: u32) -> Self;
    fn rotate_left(self, r: u32) -> Self;
    fn store(self, out: &mut [u8]);
    fn load(b: &[u8]) -> Self;
}

macro_rules! plane_word {
    ($($t:ty),*) => {$(
        impl Word for $t {
            const BYTES: usize = std::mem::size_of::<$t>();
            #[inline(always)]
            fn from_byte(b: u8) -> Self {
                <$t>::from(b)
            }
            #[inline(always)]
            fn low_byte(self) -> u8 {
                self as u8
            }
            #[inline(always)]
            fn rotate_right(self, r: u32) -> Self {
                <$t>::rotate_right(self, r)
            }
            #[inline(always)]
            fn rotate_left(self, r: u32) -> Self {
                <$t>::rotate_left(self, r)
            }
            #[inline(always)]
            fn store(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
            #[inline(always)]
            fn load(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("one element"))
            }
        }
    )*};
}
plane_word!(u16, u32, u64);

/// [`join_planes`] for elements of `W::BYTES` bytes rotated by `R` bits; with `XOR`, XORed
/// into `out`.
fn join_words<W: Word, const R: u32, const XOR: bool>(planes: &[&[u8]], out: &mut [u8]) {
    let e = W::BYTES;
    let n = out.len() / e;
    let blocks = n / PLANE_BLOCK;
    for k in 0..blocks {
        let at = k * PLANE_BLOCK;
        let mut words = [W::default(); PLANE_BLOCK];
        for (s, plane) in planes.iter().enumerate() {
            let bytes: &[u8; PLANE_BLOCK] =
                plane[at..at + PLANE_BLOCK].try_into().expect("a block");
            for (w, b) in words.iter_mut().zip(bytes) {
                *w = *w | (W::from_byte(*b) << (8 * s as u32));
            }
        }
        let dst = &mut out[at * e..(at + PLANE_BLOCK) * e];
        for (o, w) in dst.chunks_exact_mut(e).zip(words) {
            put_word::<W, R, XOR>(w, o);
        }
    }
    for i in blocks * PLANE_BLOCK..n {
        let mut w = W::default();
        for (s, plane) in planes.iter().enumerate() {
            w = w | (W::from_byte(plane[i]) << (8 * s as u32));
        }
        put_word::<W, R, XOR>(w, &mut out[i * e..(i + 1) * e]);
    }
}

#[inline(always)]
fn put_word<W: Word, const R: u32, const XOR: bool>(w: W, o: &mut [u8]) {
    let w = w.rotate_right(R);
    if XOR {
        (W::load(o) ^ w).store(o);
    } else {
        w.store(o);
    }
}

/// [`split_planes`] for elements of `W::BYTES` bytes rotated by `R` bits.
fn split_words<W: Word, const R: u32>(data: &[u8], planes: &mut [&mut [u8]]) {
    let e = W::BYTES;
    let n = data.len() / e;
    let blocks = n / PLANE_BLOCK;
    for k in 0..blocks {
        let at = k * PLANE_BLOCK;
        let mut words = [W::default(); PLANE_BLOCK];
        let src = &data[at * e..(at + PLANE_BLOCK) * e];
        for (w, c) in words.iter_mut().zip(src.chunks_exact(e)) {
            *w = W::load(c).rotate_left(R);
        }
        for (s, plane) in planes.iter_mut().enumerate() {
            let bytes: &mut [u8; PLANE_BLOCK] = (&mut plane[at..at + PLANE_BLOCK])
                .try_into()
                .expect("a block");
            for (b, w) in bytes.iter_mut().zip(words) {
                *b = (w >> (8 * s as u32)).low_byte();
            }
        }
    }
    for i in blocks * PLANE_BLOCK..n {
        let w = W::load(&data[i * e..(i + 1) * e]).rotate_left(R);
        for (s, plane) in planes.iter_mut().enumerate() {
            plane[i] = (w >> (8 * s as u32)).low_byte();
        }
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

/// Encode `data` as a delta object against `base` (the plain bytes of chunk `base_id`, the
/// same length): byte planes of the XOR, zstd at `level` where it pays. The caller decides
/// whether the result is worth keeping (it is never smaller than needed by construction).
pub fn encode_delta(
    data: &[u8],
    base: &[u8],
    base_id: &ChunkId,
    elem: usize,
    level: i32,
) -> Encoded {
    check_delta_args(data, base, elem);
    let x = xor(data, base);
    let mut parts = vec![
        Bytes::copy_from_slice(&header(Codec::Delta, elem as u8, data.len() as u64)),
        Bytes::copy_from_slice(&base_id.0.0),
    ];
    parts.append(&mut planes_payload(&x, elem, level, 0, true).expect("forced"));
    Encoded {
        codec: Codec::Delta,
        parts,
    }
}

/// A delta is kept only where it stores at most this many tenths of the plain encoding: below
/// that, the extra object a restore reads (and decodes) is not worth the saving.
pub const DELTA_MARGIN_TENTHS: usize = 9;

/// Windows sampled from a chunk to estimate its delta and plain sizes, and their size.
const ESTIMATE_WINDOWS: usize = 4;
const ESTIMATE_WINDOW: usize = 16 << 10;

/// Sizes estimated on a sample of a chunk: its delta against a base and its plain encoding
/// (both byte planes and zstd), in bytes of the sample. See [`estimate_delta`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaEstimate {
    /// The sample's raw bytes.
    pub sampled: usize,
    /// The sample stored as a delta.
    pub delta: usize,
    /// The sample stored plain.
    pub plain: usize,
}

impl DeltaEstimate {
    /// Whether the delta is expected to pay ([`DELTA_MARGIN_TENTHS`] of the plain encoding).
    pub fn pays(&self) -> bool {
        self.delta * 10 <= self.plain * DELTA_MARGIN_TENTHS
    }
}

/// The bytes of the byte planes of `data` as a delta object stores them (zstd at `level`
/// where it is smaller, else raw; without the header and the plane table).
fn planes_size(data: &[u8], elem: usize, level: i32) -> usize {
    split_planes(data, elem, true)
        .into_iter()
        .map(|p| encode_plane(p, level, 0).1.len())
        .sum()
}

/// Estimate, from [`ESTIMATE_WINDOWS`] windows spread over the chunk (64 KiB in all, 1.6 % of a
/// 4 MiB chunk), what `data` stores as a delta against `base` and what it stores plain, so a
/// writer encodes only the smaller instead of both (issue 16: trying deltas must not slow a
/// save). Same arguments as [`encode_delta`].
pub fn estimate_delta(data: &[u8], base: &[u8], elem: usize, level: i32) -> DeltaEstimate {
    check_delta_args(data, base, elem);
    let (sd, sb): (Vec<u8>, Vec<u8>) = if data.len() <= ESTIMATE_WINDOWS * ESTIMATE_WINDOW {
        (data.to_vec(), base.to_vec())
    } else {
        let mut sd = Vec::with_capacity(ESTIMATE_WINDOWS * ESTIMATE_WINDOW);
        let mut sb = Vec::with_capacity(ESTIMATE_WINDOWS * ESTIMATE_WINDOW);
        let span = data.len() - ESTIMATE_WINDOW;
        for i in 0..ESTIMATE_WINDOWS {
            let at = span * i / (ESTIMATE_WINDOWS - 1) / elem * elem;
            sd.extend_from_slice(&data[at..at + ESTIMATE_WINDOW]);
            sb.extend_from_slice(&base[at..at + ESTIMATE_WINDOW]);
        }
        (sd, sb)
    };
    DeltaEstimate {
        sampled: sd.len(),
        delta: planes_size(&xor(&sd, &sb), elem, level),
        plain: planes_size(&sd, elem, level),
    }
}

/// The base chunk a delta object names, after checking its header (`None`: not a delta).
pub fn delta_base(obj: &[u8], what: &dyn std::fmt::Display) -> Result<Option<ChunkId>> {
    let h = parse_header(obj, what)?;
    if h.codec != Codec::Delta {
        return Ok(None);
    }
    match obj.get(HEADER_LEN..HEADER_LEN + 32) {
        Some(b) => Ok(Some(ChunkId(crate::id::Hash(
            b.try_into().expect("32 bytes"),
        )))),
        None => Err(Error::corrupt(format!(
            "{what}: delta object too short for its base id (truncated?)"
        ))),
    }
}

/// The header of a delta object of `expect_len` bytes on `base_id`, checked.
fn delta_header(
    obj: &[u8],
    expect_len: u64,
    base_id: &ChunkId,
    what: &dyn std::fmt::Display,
) -> Result<Header> {
    let h = parse_header(obj, what)?;
    if h.codec != Codec::Delta {
        return Err(Error::corrupt(format!(
            "{what}: a {} object where a delta on chunk {} was expected",
            h.codec.name(),
            base_id.short()
        )));
    }
    if h.raw_len != expect_len {
        return Err(Error::corrupt(format!(
            "{what}: header says {} bytes but the manifest expects {expect_len}",
            h.raw_len
        )));
    }
    let named = delta_base(obj, what)?.expect("a delta");
    if named != *base_id {
        return Err(Error::corrupt(format!(
            "{what}: the delta names base chunk {} but the manifest says {}",
            named.short(),
            base_id.short()
        )));
    }
    Ok(h)
}

/// Decode a chunk stored as a delta chain: `objs[i]` is the object of `chain[i]`, `chain[0]`
/// the chunk itself, each a delta on the next, the last a plain object; `names[i]` says where
/// each is in errors. The bytes are built in one pass (the levels' planes XORed together,
/// one join) and hash-checked once against the chunk's id, which proves them whatever the
/// levels held. Only when that check fails is the chain decoded again level by
/// level, each level hash-checked, so that the error names the damaged one.
pub fn decode_chain(
    objs: &[&[u8]],
    chain: &[ChunkId],
    len: u64,
    names: &[String],
) -> Result<Vec<u8>> {
    assert!(
        !chain.is_empty() && objs.len() == chain.len() && names.len() == chain.len(),
        "one object and one name per level"
    );
    let last = chain.len() - 1;
    // XOR commutes with the plane split and the rotation, so the deltas' planes are XORed
    // together where they lie and joined once (into the base's planes when it is stored as
    // planes of the same shape, else XORed into its plain bytes).
    let fast = || -> Result<Vec<u8>> {
        let hb = parse_header(objs[last], &names[last])?;
        if hb.raw_len != len {
            return Err(Error::corrupt(format!("{}: wrong length", names[last])));
        }
        let mut acc: Option<(Vec<Vec<u8>>, bool)> = None;
        for i in (0..last).rev() {
            let h = delta_header(objs[i], len, &chain[i + 1], &names[i])?;
            let planes = plane_payload(&objs[i][HEADER_LEN + 32..], &h, &names[i])?;
            match &mut acc {
                None => {
                    let owned = planes.into_iter().map(|p| p.into_owned()).collect();
                    acc = Some((owned, h.rotated));
                }
                Some((a, rotated)) if *rotated == h.rotated && a.len() == planes.len() => {
                    a.iter_mut().zip(&planes).for_each(|(a, p)| xor_into(a, p));
                }
                Some(_) => {
                    return Err(Error::corrupt(format!(
                        "{}: planes of another shape than its chain's",
                        names[i]
                    )));
                }
            }
        }
        let Some((mut acc, rotated)) = acc else {
            return decode_payload(objs[last], &hb, &names[last]);
        };
        if hb.codec == Codec::Planes && hb.rotated == rotated && hb.elem as usize == acc.len() {
            let base = plane_payload(&objs[last][HEADER_LEN..], &hb, &names[last])?;
            acc.iter_mut().zip(&base).for_each(|(a, p)| xor_into(a, p));
            let mut out = vec![0u8; len as usize];
            let refs: Vec<&[u8]> = acc.iter().map(Vec::as_slice).collect();
            join_planes(&refs, &mut out, rotated);
            Ok(out)
        } else {
            let mut out = decode_payload(objs[last], &hb, &names[last])?;
            let refs: Vec<&[u8]> = acc.iter().map(Vec::as_slice).collect();
            xor_planes_into(&refs, &mut out, rotated);
            Ok(out)
        }
    };
    if let Ok(out) = fast()
        && ChunkId::of(&out) == chain[0]
    {
        return Ok(out);
    }
    let mut plain = decode(objs[last], &chain[last], len, &names[last])?;
    for i in (0..last).rev() {
        plain = decode_delta(objs[i], &chain[i], len, &chain[i + 1], &plain, &names[i])?;
    }
    Ok(plain)
}

/// Decode a delta object of chunk `id` against the plain bytes of its base `base_id`, and
/// check the result's hash. `what` names the object in messages.
pub fn decode_delta(
    obj: &[u8],
    id: &ChunkId,
    expect_len: u64,
    base_id: &ChunkId,
    base: &[u8],
    what: &dyn std::fmt::Display,
) -> Result<Vec<u8>> {
    let h = delta_header(obj, expect_len, base_id, what)?;
    if base.len() as u64 != expect_len {
        return Err(Error::corrupt(format!(
            "{what}: the manifest expects {expect_len} bytes but its base holds {}",
            base.len()
        )));
    }
    let mut out = base.to_vec();
    decode_planes_into(&obj[HEADER_LEN + 32..], &h, what, &mut out, true)?;
    let got = ChunkId::of(&out);
    if got != *id {
        return Err(Error::corrupt(format!(
            "{what}: content hash is {} but should be {} (the delta or its base chunk {} is damaged)",
            got.short(),
            id.short(),
            base_id.short()
        )));
    }
    Ok(out)
}

/// Check a delta object's structure without its base (whole-store verify of an object no
/// manifest references): header, base id, and that every plane decodes to its length.
pub fn check_delta_structure(obj: &[u8], what: &dyn std::fmt::Display) -> Result<u64> {
    let h = parse_header(obj, what)?;
    if delta_base(obj, what)?.is_none() {
        return Err(Error::corrupt(format!("{what}: not a delta object")));
    }
    decode_planes(&obj[HEADER_LEN + 32..], &h, what)?;
    Ok(h.raw_len)
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
    let out = decode_payload(obj, &h, what)?;
    check_id(&out, id, what)?;
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
    let h = parse_header(&obj, what)?;
    if h.codec != Codec::Raw {
        return decode(&obj, id, expect_len, what).map(Bytes::from);
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
    check_id(&payload, id, what)?;
    Ok(payload)
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
    let got = ChunkId::of(plain);
    if got != *id {
        return Err(Error::corrupt(format!(
            "{what}: content hash is {} but should be {} (the bytes are damaged)",
            got.short(),
            id.short()
        )));
    }
    Ok(())
}

/// Decode a chunk object whose id is known but whose length is not (verifying the whole
/// store): the length comes from the header, already bounded by [`MAX_CHUNK_LEN`].
pub fn decode_verify(obj: &[u8], id: &ChunkId, what: &dyn std::fmt::Display) -> Result<Vec<u8>> {
    let h = parse_header(obj, what)?;
    decode(obj, id, h.raw_len, what)
}

fn decode_payload(obj: &[u8], h: &Header, what: &dyn std::fmt::Display) -> Result<Vec<u8>> {
    let payload = &obj[HEADER_LEN..];
    let raw_len = h.raw_len as usize;
    let corrupt = |m: String| Error::corrupt(format!("{what}: {m}"));
    match h.codec {
        Codec::Raw => {
            if payload.len() != raw_len {
                return Err(corrupt(format!(
                    "raw payload holds {} bytes, header says {raw_len} (truncated?)",
                    payload.len()
                )));
            }
            Ok(payload.to_vec())
        }
        Codec::Zstd => {
            let mut out = vec![0u8; raw_len];
            decompress_into(payload, &mut out).map_err(corrupt)?;
            Ok(out)
        }
        Codec::Planes => decode_planes(payload, h, what),
        Codec::Delta => Err(Error::corrupt(format!(
            "{what}: a delta object cannot be decoded without its base chunk (a manifest names it)"
        ))),
    }
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
                let mut p = vec![0u8; n];
                decompress_into(src, &mut p)
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

/// `acc ^= p`, byte by byte (the same length).
fn xor_into(acc: &mut [u8], p: &[u8]) {
    for (a, b) in acc.iter_mut().zip(p) {
        *a ^= b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn normal_bf16(n: usize, seed: u64) -> Vec<u8> {
        // Box-Muller over a splitmix stream: N(0, 0.02) weights as bf16.
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_add(0x9E3779B97F4A7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
            ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut out = Vec::with_capacity(n * 2);
        for _ in 0..n {
            let (u1, u2) = (next().max(1e-300), next());
            let x = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos() * 0.02;
            let bits = (x as f32).to_bits();
            out.extend_from_slice(&((bits >> 16) as u16).to_le_bytes());
        }
        out
    }

    fn round_trip(data: &[u8], elem: usize, policy: CodecPolicy) -> Codec {
        let b = Bytes::copy_from_slice(data);
        let enc = encode(&b, elem, policy);
        let obj = enc.to_bytes();
        let id = ChunkId::of(data);
        let back = decode(&obj, &id, data.len() as u64, &"test").unwrap();
        assert_eq!(back, data);
        enc.codec
    }

    #[test]
    fn every_codec_round_trips() {
        let w = normal_bf16(50_000, 1);
        assert_eq!(round_trip(&w, 2, CodecPolicy::FAST), Codec::Planes);
        assert_eq!(round_trip(&w, 2, CodecPolicy::Raw), Codec::Raw);
        let zeros = vec![0u8; 100_000];
        assert_eq!(round_trip(&zeros, 1, CodecPolicy::FAST), Codec::Zstd);
        assert_eq!(round_trip(&zeros, 4, CodecPolicy::MAX), Codec::Planes);
        assert_eq!(round_trip(&[], 1, CodecPolicy::FAST), Codec::Raw);
        assert_eq!(round_trip(&[7u8; 3], 2, CodecPolicy::FAST), Codec::Raw);
        // A length that is not a multiple of the element size cannot use planes.
        assert_eq!(
            round_trip(&zeros[..99_999], 2, CodecPolicy::FAST),
            Codec::Zstd
        );
        for elem in [4, 8] {
            let d: Vec<u8> = (0..80_000u32)
                .flat_map(|i| (i as f32).to_le_bytes())
                .collect();
            round_trip(&d[..d.len() / elem * elem], elem, CodecPolicy::FAST);
        }
    }

    #[test]
    fn incompressible_data_is_stored_raw() {
        let mut s = 12345u64;
        let d: Vec<u8> = (0..200_000)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect();
        assert_eq!(round_trip(&d, 1, CodecPolicy::MAX), Codec::Raw);
        assert_eq!(round_trip(&d, 4, CodecPolicy::MAX), Codec::Raw);
    }

    #[test]
    fn bf16_weights_compress_with_planes() {
        let w = normal_bf16(1 << 20, 7);
        let enc = encode(&Bytes::from(w.clone()), 2, CodecPolicy::FAST);
        let ratio = enc.len() as f64 / w.len() as f64;
        assert_eq!(enc.codec, Codec::Planes);
        assert!(ratio < 0.75, "bf16 byte planes ratio {ratio}");
    }

    #[test]
    fn damage_is_named() {
        let w = normal_bf16(10_000, 3);
        let id = ChunkId::of(&w);
        let obj = encode(&Bytes::from(w.clone()), 2, CodecPolicy::FAST).to_bytes();
        let n = w.len() as u64;

        // Flipped byte in the payload: zstd error or hash mismatch, never silent.
        let mut bad = obj.to_vec();
        let last = bad.len() - 1;
        bad[last] ^= 0x40;
        let e = decode(&bad, &id, n, &"chunk X").unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Corrupt);
        assert!(e.to_string().starts_with("chunk X:"), "{e}");

        // Truncated.
        let e = decode(&obj[..obj.len() / 2], &id, n, &"chunk X").unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Corrupt, "{e}");
        let e = decode(&obj[..5], &id, n, &"chunk X").unwrap_err();
        assert!(e.to_string().contains("too short"), "{e}");

        // Garbage.
        let e = decode(b"this is not a chunk at all", &id, n, &"chunk X").unwrap_err();
        assert!(e.to_string().contains("bad magic"), "{e}");

        // A header claiming a terabyte is refused before allocating.
        let mut tb = obj.to_vec();
        tb[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        let e = decode_verify(&tb, &id, &"chunk X").unwrap_err();
        assert!(e.to_string().contains("claims 1099511627776 bytes"), "{e}");

        // Length disagreeing with the manifest.
        let e = decode(&obj, &id, n + 1, &"chunk X").unwrap_err();
        assert!(e.to_string().contains("manifest expects"), "{e}");

        // Raw chunk with a flipped byte: caught by the hash.
        let raw = encode(&Bytes::from(w.clone()), 2, CodecPolicy::Raw).to_bytes();
        let mut bad = raw.to_vec();
        bad[100] ^= 1;
        let e = decode(&bad, &id, n, &"chunk X").unwrap_err();
        assert!(e.to_string().contains("content hash"), "{e}");
        // The same through `decode_bytes`, which hands a raw chunk out without a copy.
        let got = decode_bytes(raw.clone(), &id, n, &"chunk X").unwrap();
        assert!(got == w && got.as_ptr() == raw[HEADER_LEN..].as_ptr());
        let e = decode_bytes(Bytes::from(bad), &id, n, &"chunk X").unwrap_err();
        assert!(e.to_string().contains("content hash"), "{e}");
        let e = decode_bytes(raw.slice(..raw.len() - 1), &id, n, &"chunk X").unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        assert!(decode_bytes(obj.clone(), &id, n, &"chunk X").unwrap() == w);
    }

    /// Byte `k` of element `i` of `data` after rotating the element left by `r` bits: what
    /// plane `k` holds at `i`, computed one element at a time.
    fn plane_byte(data: &[u8], elem: usize, r: u32, i: usize, k: usize) -> u8 {
        let mut v = [0u8; 8];
        v[..elem].copy_from_slice(&data[i * elem..(i + 1) * elem]);
        let w = u64::from_le_bytes(v);
        let bits = 8 * elem as u32;
        let mask = if bits == 64 {
            u64::MAX
        } else {
            (1 << bits) - 1
        };
        let rot = if r == 0 {
            w
        } else {
            ((w << r) | (w >> (bits - r))) & mask
        };
        (rot >> (8 * k)) as u8
    }

    #[test]
    fn plane_kernels_match_the_element_at_a_time_definition() {
        // Lengths around the kernels' block: whole blocks, a tail, a tail alone.
        for elem in [2usize, 4, 8] {
            for n in [0, 1, 63, 64, 65, 64 * 3 + 5, 1000] {
                let d: Vec<u8> = (0..n * elem)
                    .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
                    .collect();
                for rotate in [false, true] {
                    let planes = split_planes(&d, elem, rotate);
                    for (k, p) in planes.iter().enumerate() {
                        assert_eq!(p.len(), n);
                        for (i, b) in p.iter().enumerate() {
                            let want = plane_byte(&d, elem, u32::from(rotate), i, k);
                            assert_eq!(
                                *b, want,
                                "elem {elem} n {n} rotate {rotate} plane {k} at {i}"
                            );
                        }
                    }
                    let refs: Vec<&[u8]> = planes.iter().map(Vec::as_slice).collect();
                    let mut out = vec![0xa5u8; d.len()];
                    join_planes(&refs, &mut out, rotate);
                    assert!(out == d, "elem {elem} n {n} rotate {rotate}: join");
                }
            }
        }
    }

    #[test]
    fn planes_split_and_join_are_inverse() {
        for elem in [2usize, 4, 8] {
            let d: Vec<u8> = (0..(elem * 37)).map(|i| (i * 7) as u8).collect();
            for rotate in [false, true] {
                let planes = split_planes(&d, elem, rotate);
                if !rotate {
                    assert_eq!(planes[1][0], d[1]);
                }
                let refs: Vec<&[u8]> = planes.iter().map(Vec::as_slice).collect();
                let mut out = vec![0u8; d.len()];
                join_planes(&refs, &mut out, rotate);
                assert_eq!(out, d);
            }
            // Rotated bf16/f32: the top plane is the exponent.
            if elem == 4 {
                let x = (-1.5f32).to_le_bytes();
                let p = split_planes(&x, 4, true);
                assert_eq!(p[3][0], ((-1.5f32).to_bits() >> 23) as u8);
            }
        }
    }

    #[test]
    fn deltas_round_trip_and_check_their_base() {
        // bf16 weights and the same after a small update of every element.
        let a = normal_bf16(50_000, 11);
        let b: Vec<u8> = a
            .chunks_exact(2)
            .enumerate()
            .flat_map(|(i, c)| {
                let v = u16::from_le_bytes([c[0], c[1]]);
                let v = if i % 3 == 0 { v ^ 1 } else { v };
                v.to_le_bytes()
            })
            .collect();
        let (ia, ib) = (ChunkId::of(&a), ChunkId::of(&b));
        let d = encode_delta(&b, &a, &ia, 2, 1);
        assert_eq!(d.codec, Codec::Delta);
        let plain = encode(&Bytes::from(b.clone()), 2, CodecPolicy::FAST);
        assert!(d.len() * 4 < plain.len(), "{} vs {}", d.len(), plain.len());
        let obj = d.to_bytes();
        assert_eq!(obj[4], CHUNK_FORMAT_DELTA);
        assert_eq!(delta_base(&obj, &"d").unwrap(), Some(ia));
        let n = b.len() as u64;
        assert_eq!(decode_delta(&obj, &ib, n, &ia, &a, &"d").unwrap(), b);
        assert_eq!(check_delta_structure(&obj, &"d").unwrap(), n);
        // Without its base a delta does not decode; with the wrong one the hash says so.
        let e = decode(&obj, &ib, n, &"d").unwrap_err();
        assert!(e.to_string().contains("without its base"), "{e}");
        let e = decode_delta(&obj, &ib, n, &ib, &b, &"d").unwrap_err();
        assert!(e.to_string().contains("names base"), "{e}");
        let mut other = a.clone();
        other[7] ^= 0x10;
        let e = decode_delta(&obj, &ib, n, &ia, &other, &"d").unwrap_err();
        assert!(e.to_string().contains("content hash"), "{e}");
        // A delta header in a format 1 object, or a format 2 object of another codec: damaged.
        let mut bad = obj.to_vec();
        bad[4] = CHUNK_FORMAT;
        assert!(parse_header(&bad, &"d").is_err());
        let mut bad = plain.to_bytes().to_vec();
        bad[4] = CHUNK_FORMAT_DELTA;
        assert!(parse_header(&bad, &"d").is_err());
        // Truncated.
        assert!(decode_delta(&obj[..40], &ib, n, &ia, &a, &"d").is_err());
        assert!(delta_base(&obj[..20], &"d").is_err());
    }

    #[test]
    fn a_chain_decodes_in_one_pass_and_a_damaged_level_is_named() {
        // Three saves of the same bf16 region: a plain base and two deltas on it.
        let a = normal_bf16(60_000, 5);
        let step = |d: &[u8], every: usize| -> Vec<u8> {
            d.chunks_exact(2)
                .enumerate()
                .flat_map(|(i, c)| {
                    let v = u16::from_le_bytes([c[0], c[1]]);
                    let v = if i % every == 0 { v ^ 3 } else { v };
                    v.to_le_bytes()
                })
                .collect()
        };
        let b = step(&a, 3);
        let c = step(&b, 5);
        let (ia, ib, ic) = (ChunkId::of(&a), ChunkId::of(&b), ChunkId::of(&c));
        let pa = encode(&Bytes::from(a.clone()), 2, CodecPolicy::FAST).to_bytes();
        assert_eq!(
            pa[5],
            Codec::Planes.tag(),
            "the base is stored as byte planes"
        );
        let db = encode_delta(&b, &a, &ia, 2, 1).to_bytes();
        let dc = encode_delta(&c, &b, &ib, 2, 1).to_bytes();
        let names: Vec<String> = ["top", "middle", "base"].map(String::from).to_vec();
        let ids = [ic, ib, ia];
        let n = c.len() as u64;
        let got = decode_chain(&[&dc, &db, &pa], &ids, n, &names).unwrap();
        assert!(got == c, "the chain decodes to the newest bytes");
        // One level of two.
        let got = decode_chain(&[&db, &pa], &[ib, ia], n, &names[1..]).unwrap();
        assert!(got == b);
        // A base stored raw (the governor's choice on a fast disk): its bytes take the planes.
        let ra = encode(&Bytes::from(a.clone()), 2, CodecPolicy::Raw).to_bytes();
        let got = decode_chain(&[&dc, &db, &ra], &ids, n, &names).unwrap();
        assert!(got == c, "on a raw base");
        // A plain chunk alone is a chain of one.
        assert!(decode_chain(&[&pa], &[ia], n, &names[2..]).unwrap() == a);
        // A flipped byte in any level: the error names that level.
        for (level, obj) in [(0, &dc), (1, &db), (2, &pa)] {
            let mut bad = obj.to_vec();
            let at = bad.len() - 7;
            bad[at] ^= 0x10;
            let mut objs: Vec<&[u8]> = vec![&dc, &db, &pa];
            objs[level] = &bad;
            let e = decode_chain(&objs, &ids, n, &names).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::Corrupt, "{e}");
            assert!(
                e.to_string().starts_with(&names[level]),
                "level {level}: {e}"
            );
        }
        // A level left out: the delta names another base than the chain.
        let e = decode_chain(&[&dc, &pa], &[ic, ia], n, &names[1..]).unwrap_err();
        assert!(e.to_string().contains("names base"), "{e}");
        assert!(e.to_string().starts_with("middle"), "{e}");
    }

    #[test]
    fn the_sampled_estimate_picks_what_the_whole_chunk_shows() {
        // 4 MiB of bf16 weights; `small` changes a third of the elements in the lowest bit
        // (a delta pays), `large` replaces every element (a delta costs more than plain).
        let a = normal_bf16(2 << 20, 21);
        let small: Vec<u8> = a
            .chunks_exact(2)
            .enumerate()
            .flat_map(|(i, c)| {
                let v = u16::from_le_bytes([c[0], c[1]]);
                (if i % 3 == 0 { v ^ 1 } else { v }).to_le_bytes()
            })
            .collect();
        let large = normal_bf16(2 << 20, 22);
        let ia = ChunkId::of(&a);
        for (b, pays) in [(&small, true), (&large, false)] {
            let est = estimate_delta(b, &a, 2, 1);
            assert_eq!(est.sampled, 4 * ESTIMATE_WINDOW, "a sample, not the chunk");
            assert_eq!(est.pays(), pays, "{est:?}");
            let whole = encode_delta(b, &a, &ia, 2, 1).len();
            let plain = encode(&Bytes::from(b.clone()), 2, CodecPolicy::FAST).len();
            assert_eq!(
                whole * 10 <= plain * DELTA_MARGIN_TENTHS,
                pays,
                "{whole} vs {plain}"
            );
            // The estimate's ratios are those of the whole chunk, within a few hundredths.
            let (er, wr) = (
                est.delta as f64 / est.plain as f64,
                whole as f64 / plain as f64,
            );
            assert!(
                (er - wr).abs() < 0.05,
                "estimated {er:.3}, whole chunk {wr:.3}"
            );
        }
        // A chunk smaller than the windows is estimated whole.
        let est = estimate_delta(&small[..1000], &a[..1000], 2, 1);
        assert_eq!(est.sampled, 1000);
    }
}
