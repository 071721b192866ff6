//! Decoding a chunk straight into its destination: its plain bytes are written once, where
//! the caller wants them (a restore: the tensor's memory), and each block is hashed right
//! after it is written, while it is in the core's cache. No buffer of the plain chunk, no
//! second copy, no second pass over memory for the hash.

use std::borrow::Cow;

use super::delta::{decode_delta, delta_header};
use super::planes::{join_planes, xor_into, xor_planes_into};
use super::{
    Codec, HEADER_LEN, Header, check_id_of, check_len, decode, decompress_into, parse_header,
    plane_payload,
};
use crate::error::{Error, Result};
use crate::id::ChunkId;

/// Bytes of plain output written, then hashed, at a time: the block is still in the core's
/// cache when the hash reads it. A multiple of every element size.
const BLOCK: usize = 256 << 10;

/// Where the plain bytes of a non-delta object come from, block by block.
pub(super) enum Plain<'a> {
    /// A raw payload, copied out as each block is written.
    Raw(&'a [u8]),
    /// Byte planes (raw ones where they lie), joined as each block is written.
    Planes(Vec<Cow<'a, [u8]>>, bool),
    /// Already in the destination (a zstd frame decompresses whole).
    Written,
}

/// The plain bytes of a non-delta object `obj` (header `h`, already parsed) for a destination
/// of `out.len()` bytes: a zstd frame is decompressed into `out` here; anything else is
/// written block by block by [`write_hashed`].
pub(super) fn plain_of<'a>(
    obj: &'a [u8],
    h: &Header,
    what: &dyn std::fmt::Display,
    out: &mut [u8],
) -> Result<Plain<'a>> {
    let payload = &obj[HEADER_LEN..];
    let corrupt = |m: String| Error::corrupt(format!("{what}: {m}"));
    check_len(h, out.len() as u64, what)?;
    match h.codec {
        Codec::Raw if payload.len() != out.len() => Err(corrupt(format!(
            "raw payload holds {} bytes, header says {} (truncated?)",
            payload.len(),
            h.raw_len
        ))),
        Codec::Raw => Ok(Plain::Raw(payload)),
        Codec::Zstd => {
            decompress_into(payload, out).map_err(corrupt)?;
            Ok(Plain::Written)
        }
        Codec::Planes => Ok(Plain::Planes(plane_payload(payload, h, what)?, h.rotated)),
        Codec::Delta => Err(corrupt(
            "a delta object cannot be decoded without its base chunk (a manifest names it)".into(),
        )),
    }
}

/// Write `plain` into `out` a block at a time, XOR `xor`'s planes into each block where there
/// are any (a delta chain's levels, XORed together), and hash each block right after: the
/// hash of the bytes `out` holds at the end.
pub(super) fn write_hashed(
    plain: &Plain<'_>,
    xor: Option<(&[Vec<u8>], bool)>,
    out: &mut [u8],
) -> ChunkId {
    let mut hasher = blake3::Hasher::new();
    for (k, o) in out.chunks_mut(BLOCK).enumerate() {
        let at = k * BLOCK;
        match plain {
            Plain::Raw(p) => o.copy_from_slice(&p[at..at + o.len()]),
            Plain::Planes(planes, rotated) => {
                with_block(planes, at, o.len(), |b| join_planes(b, o, *rotated));
            }
            Plain::Written => {}
        }
        if let Some((planes, rotated)) = xor {
            with_block(planes, at, o.len(), |b| xor_planes_into(b, o, rotated));
        }
        hasher.update(o);
    }
    ChunkId(crate::id::Hash(*hasher.finalize().as_bytes()))
}

/// Call `f` with the part of each plane that makes the `len` plain bytes from byte `at` (the
/// planes' elements `at / elem ..`; `at` and `len` are whole elements).
fn with_block<P: AsRef<[u8]>>(planes: &[P], at: usize, len: usize, f: impl FnOnce(&[&[u8]])) {
    let elem = planes.len();
    let (e0, e1) = (at / elem, (at + len) / elem);
    let mut block: [&[u8]; 8] = [&[]; 8];
    for (b, p) in block.iter_mut().zip(planes) {
        *b = &p.as_ref()[e0..e1];
    }
    f(&block[..elem]);
}

/// Decode a chunk into `out` (exactly its plain length) and check it against `chain[0]`, its
/// id. `objs` is the chunk's chain of stored objects: its own, then for a delta each base's,
/// each a delta on the next and the last a plain object (one object for a chunk that is not
/// a delta); `names[i]` says where each is in errors.
///
/// A chain's levels are XORed together where they lie (XOR commutes with the plane split and
/// the rotation) and written once, so the bytes are proven by the one check against the
/// chunk's id whatever the levels held. Only when that check fails is the chain decoded again
/// level by level, each level checked, so that the error names the damaged one. On an error
/// `out` holds nothing of use.
pub fn decode_into(
    objs: &[&[u8]],
    chain: &[ChunkId],
    names: &[String],
    out: &mut [u8],
) -> Result<()> {
    assert!(
        !chain.is_empty() && objs.len() == chain.len() && names.len() == chain.len(),
        "one object and one name per level"
    );
    if objs.len() == 1 {
        let h = parse_header(objs[0], &names[0])?;
        let plain = plain_of(objs[0], &h, &names[0], out)?;
        return check_id_of(write_hashed(&plain, None, out), &chain[0], &names[0]);
    }
    if let Ok(got) = chain_into(objs, chain, names, out)
        && got == chain[0]
    {
        return Ok(());
    }
    let plain = by_levels(objs, chain, out.len() as u64, names)?;
    out.copy_from_slice(&plain);
    Ok(())
}

/// Write a delta chain's plain bytes into `out` in one pass: every delta level's planes XORed
/// together, then joined with the base's planes (the same shape) or XORed into its plain
/// bytes. The hash of what `out` then holds (not yet checked).
fn chain_into(
    objs: &[&[u8]],
    chain: &[ChunkId],
    names: &[String],
    out: &mut [u8],
) -> Result<ChunkId> {
    let last = objs.len() - 1;
    let len = out.len() as u64;
    let hb = parse_header(objs[last], &names[last])?;
    let mut acc: Option<(Vec<Vec<u8>>, bool)> = None;
    for i in (0..last).rev() {
        let h = delta_header(objs[i], len, &chain[i + 1], &names[i])?;
        let planes = plane_payload(&objs[i][HEADER_LEN + 32..], &h, &names[i])?;
        match &mut acc {
            None => {
                let owned = planes.into_iter().map(Cow::into_owned).collect();
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
    let (acc, rotated) = acc.expect("a chain of two or more levels has a delta");
    // The base written a block at a time (its planes joined, or its raw bytes copied), the
    // levels' planes XORed into each block while it is in the core's cache: no pass of its
    // own over the XORed planes.
    let base = plain_of(objs[last], &hb, &names[last], out)?;
    Ok(write_hashed(&base, Some((&acc, rotated)), out))
}

/// A delta chain decoded level by level, the base first, each level's bytes checked against
/// its id: slower than [`chain_into`], but an error names the level at fault.
fn by_levels(objs: &[&[u8]], chain: &[ChunkId], len: u64, names: &[String]) -> Result<Vec<u8>> {
    let last = objs.len() - 1;
    let mut plain = decode(objs[last], &chain[last], len, &names[last])?;
    for i in (0..last).rev() {
        plain = decode_delta(objs[i], &chain[i], len, &chain[i + 1], &plain, &names[i])?;
    }
    Ok(plain)
}

/// [`decode_into`] into a buffer of its own, `len` bytes.
pub fn decode_chain(
    objs: &[&[u8]],
    chain: &[ChunkId],
    len: u64,
    names: &[String],
) -> Result<Vec<u8>> {
    // The length is the manifest's: checked against the chunk's own header (which bounds
    // it) before anything is allocated.
    let h = parse_header(objs[0], &names[0])?;
    check_len(&h, len, &names[0])?;
    let mut out = vec![0u8; len as usize];
    decode_into(objs, chain, names, &mut out)?;
    Ok(out)
}
