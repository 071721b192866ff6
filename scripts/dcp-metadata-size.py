#!/usr/bin/env python3
"""The size of DCP's `.metadata` for the items `ckpt-bench dcp-model --items FILE` lists.

Builds PyTorch Distributed Checkpoint's own objects, as `FileSystemWriter.finish` does
(`Metadata` with a `TensorStorageMetadata` of every tensor and its `ChunkStorageMetadata`
chunks, and `storage_data` mapping each item's `MetadataIndex` to its `_StorageInfo`: file,
offset, length), then pickles them like DCP does and prints the byte count as JSON.
The shapes are the scale bench's scaled-down ones: with a real model's larger dimensions and
offsets, a few more bytes per integer (a lower bound).

Usage: scripts/dcp-metadata-size.py ITEMS.jsonl
"""

import json
import pickle
import sys

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16,
          "f64": torch.float64, "i64": torch.int64, "i32": torch.int32, "u8": torch.uint8}
SIZES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.float64: 8,
         torch.int64: 8, torch.int32: 4, torch.uint8: 1}


def main(path):
    tensors = {}
    storage = {}
    file_end = {}
    items = 0
    with open(path) as f:
        for line in f:
            it = json.loads(line)
            dtype = DTYPES.get(it["dtype"], torch.float32)
            md = tensors.get(it["fqn"])
            if md is None:
                md = TensorStorageMetadata(
                    properties=TensorProperties(dtype=dtype),
                    size=torch.Size(it["shape"]),
                    chunks=[],
                )
                tensors[it["fqn"]] = md
            offsets = torch.Size(it["offsets"])
            sizes = torch.Size(it["sizes"])
            md.chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            length = SIZES[dtype]
            for s in it["sizes"]:
                length *= s
            rel = f"__{it['rank']}_0.distcp"
            start = file_end.get(rel, 0)
            file_end[rel] = start + length
            storage[MetadataIndex(it["fqn"], offsets)] = _StorageInfo(rel, start, length)
            items += 1
    meta = Metadata(state_dict_metadata=tensors, storage_data=storage)
    size = len(pickle.dumps(meta))
    print(json.dumps({"items": items, "tensors": len(tensors), "files": len(file_end),
                      "metadata_bytes": size, "bytes_per_item": size / max(items, 1)}))


if __name__ == "__main__":
    main(sys.argv[1])
