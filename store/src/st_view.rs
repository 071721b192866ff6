//! A committed step as one virtual safetensors file: the header is computed from the commit
//! record, and any byte range is read through the read engine, fetching only the chunks under
//! it. `ckpt export` streams this view to disk and the FUSE mount serves it as
//! `model.safetensors`, so both produce the same bytes.
//!
//! Layout: 8-byte little-endian header length, the JSON header (tensors in name order with
//! `dtype`, `shape`, `data_offsets`, plus `__metadata__`), padded with spaces to a multiple of
//! 8, then the tensors' row-major bytes back to back in the same order.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use crate::error::{Error, Result};
use crate::model::{CommitRecord, DType, NdBox};
use crate::placement::flat_range_boxes;
use crate::read::{ReadStats, StepReader};

/// One tensor in the view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewEntry {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Absolute offset of its first byte in the file.
    pub start: u64,
    /// Byte length.
    pub len: u64,
}

/// A virtual safetensors file over (some of) the tensors of a committed step.
#[derive(Debug, Clone)]
pub struct SafetensorsView {
    header: Vec<u8>,
    entries: Vec<ViewEntry>,
    total: u64,
}

impl SafetensorsView {
    /// The view of every tensor of `commit` (or only `names`, in name order).
    pub fn new(commit: &CommitRecord, names: Option<&[String]>) -> Result<Self> {
        let mut metadata = BTreeMap::new();
        metadata.insert("format".to_string(), "pt".to_string());
        metadata.insert("ckpt.run".to_string(), commit.run.clone());
        metadata.insert("ckpt.step".to_string(), commit.step.to_string());
        metadata.insert("ckpt.layout".to_string(), commit.layout.to_string());
        let mut chosen: Vec<(&str, DType, &[u64])> = Vec::new();
        match names {
            None => chosen.extend(
                commit
                    .tensors
                    .iter()
                    .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice())),
            ),
            Some(ns) => {
                let mut ns: Vec<&String> = ns.iter().collect();
                ns.sort();
                ns.dedup();
                for n in ns {
                    let t = commit.tensor(n).ok_or_else(|| {
                        Error::not_found(format!(
                            "step {} of run {}: no tensor named {n:?}",
                            commit.step, commit.run
                        ))
                    })?;
                    chosen.push((t.name.as_str(), t.dtype, t.shape.as_slice()));
                }
            }
        }
        Self::build(&chosen, &metadata)
    }

    fn build(
        tensors: &[(&str, DType, &[u64])],
        metadata: &BTreeMap<String, String>,
    ) -> Result<Self> {
        let mut map = Map::new();
        map.insert("__metadata__".into(), json!(metadata));
        let mut at = 0u64;
        let mut rel = Vec::with_capacity(tensors.len());
        for (name, dtype, shape) in tensors {
            if *name == "__metadata__" {
                return Err(Error::invalid(
                    "a tensor named \"__metadata__\" cannot be stored in safetensors",
                ));
            }
            let len = NdBox::full(shape).numel() * dtype.size() as u64;
            map.insert(
                name.to_string(),
                json!({
                    "dtype": dtype.safetensors_name(),
                    "shape": shape,
                    "data_offsets": [at, at + len],
                }),
            );
            rel.push((name.to_string(), *dtype, shape.to_vec(), at, len));
            at += len;
        }
        let mut json = serde_json::to_vec(&Value::Object(map))
            .map_err(|e| Error::internal(format!("safetensors header: {e}")))?;
        while !json.len().is_multiple_of(8) {
            json.push(b' ');
        }
        let mut header = (json.len() as u64).to_le_bytes().to_vec();
        header.extend_from_slice(&json);
        let base = header.len() as u64;
        let entries = rel
            .into_iter()
            .map(|(name, dtype, shape, start, len)| ViewEntry {
                name,
                dtype,
                shape,
                start: base + start,
                len,
            })
            .collect();
        Ok(SafetensorsView {
            total: base + at,
            header,
            entries,
        })
    }

    /// File size.
    pub fn len(&self) -> u64 {
        self.total
    }

    /// No bytes (never: there is always a header).
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// The header bytes (length prefix and JSON).
    pub fn header(&self) -> &[u8] {
        &self.header
    }

    /// The tensors, in file order.
    pub fn entries(&self) -> &[ViewEntry] {
        &self.entries
    }

    /// Read `buf.len()` bytes at `offset` (fewer at the end of the file); returns the count.
    pub async fn read_at(
        &self,
        reader: &StepReader,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(usize, ReadStats)> {
        let mut stats = ReadStats::default();
        if offset >= self.total {
            return Ok((0, stats));
        }
        let end = (offset + buf.len() as u64).min(self.total);
        let n = (end - offset) as usize;
        let hl = self.header.len() as u64;
        if offset < hl {
            let h_end = end.min(hl);
            buf[..(h_end - offset) as usize]
                .copy_from_slice(&self.header[offset as usize..h_end as usize]);
        }
        let first = self.entries.partition_point(|e| e.start + e.len <= offset);
        for e in &self.entries[first..] {
            if e.start >= end {
                break;
            }
            let a = offset.max(e.start) - e.start;
            let b = end.min(e.start + e.len) - e.start;
            if a >= b {
                continue;
            }
            let elem = e.dtype.size() as u64;
            let (ea, eb) = (a / elem, b.div_ceil(elem));
            let dst_base = (e.start + a - offset) as usize;
            if a % elem == 0 && b % elem == 0 {
                let mut at = dst_base;
                for bx in flat_range_boxes(&e.shape, ea, eb) {
                    let len = (bx.numel() * elem) as usize;
                    let st = reader
                        .read_into(&e.name, &bx, &mut buf[at..at + len])
                        .await?;
                    stats.add(&st);
                    at += len;
                }
            } else {
                // Partial elements at the edges: read whole elements, copy the part asked.
                let mut tmp = vec![0u8; ((eb - ea) * elem) as usize];
                let mut at = 0usize;
                for bx in flat_range_boxes(&e.shape, ea, eb) {
                    let len = (bx.numel() * elem) as usize;
                    let st = reader
                        .read_into(&e.name, &bx, &mut tmp[at..at + len])
                        .await?;
                    stats.add(&st);
                    at += len;
                }
                let skip = (a - ea * elem) as usize;
                let len = (b - a) as usize;
                buf[dst_base..dst_base + len].copy_from_slice(&tmp[skip..skip + len]);
            }
        }
        Ok((n, stats))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_padded_and_offsets_follow_name_order() {
        let md = BTreeMap::new();
        let v =
            SafetensorsView::build(&[("a", DType::Bf16, &[3]), ("b", DType::F32, &[2, 2])], &md)
                .unwrap();
        let hl = u64::from_le_bytes(v.header()[..8].try_into().unwrap());
        assert_eq!(hl % 8, 0);
        assert_eq!(v.entries()[0].start, 8 + hl);
        assert_eq!(v.entries()[1].start, 8 + hl + 6);
        assert_eq!(v.len(), 8 + hl + 6 + 16);
        let j: Value = serde_json::from_slice(&v.header()[8..]).unwrap();
        assert_eq!(j["b"]["data_offsets"], json!([6, 22]));
        assert_eq!(j["a"]["dtype"], "BF16");
    }
}
