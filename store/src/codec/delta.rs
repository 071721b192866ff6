//! Delta objects (codec 3, format 2, issue 16): a chunk as byte planes of its XOR with a base
//! chunk; encoding, the sampled estimate of whether one pays, and decoding a chain of them.

use bytes::Bytes;

use super::planes::split_planes;
use super::{
    Codec, Encoded, HEADER_LEN, Header, decode_planes, decode_planes_into, encode_plane, header,
    parse_header, planes_payload,
};
use crate::error::{Error, Result};
use crate::id::ChunkId;

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
pub(super) const ESTIMATE_WINDOW: usize = 16 << 10;

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

/// Estimate, from `ESTIMATE_WINDOWS` windows spread over the chunk (64 KiB in all, 1.6 % of a
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
pub(super) fn delta_header(
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
