"""The bytes each rank writes of a data-parallel state (every tensor on every rank: DDP's
parameters and optimizer state), with the writer of each tensor picked as
``ckpt.CheckpointManager`` picks it (``ckpt.manager._balanced_writers``: largest first, each to
the rank that writes the fewest bytes so far) and as it did before (``zlib.crc32`` of the name
modulo the world size). On a cluster each rank writes over its own node's link, so the busiest
rank's bytes over its share (max / mean) is what a checkpoint's time to durable pays.

    python python/bench/writer_balance.py [--json out.jsonl]

The states: GPT-2 124M and Llama-2 7B shapes (fp32 weights and Adam's two moments, named as
``torch.distributed.checkpoint.state_dict.get_state_dict`` names them). Nothing is saved:
the writers are computed, exactly as a save computes them.
"""

from __future__ import annotations

import argparse
import json
import zlib

from ckpt.manager import _balanced_writers


def llama(layers: int, d: int, ff: int, vocab: int) -> dict:
    t = {"model.embed_tokens.weight": vocab * d}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{n}.weight"] = d * d
        for n in ("gate_proj", "up_proj", "down_proj"):
            t[p + f"mlp.{n}.weight"] = d * ff
        t[p + "input_layernorm.weight"] = d
        t[p + "post_attention_layernorm.weight"] = d
    t["model.norm.weight"] = d
    t["lm_head.weight"] = vocab * d
    return t


def gpt2(layers: int, d: int, vocab: int, ctx: int) -> dict:
    t = {"transformer.wte.weight": vocab * d, "transformer.wpe.weight": ctx * d}
    for i in range(layers):
        p = f"transformer.h.{i}."
        for n, k in (("ln_1.weight", d), ("ln_1.bias", d), ("attn.c_attn.weight", 3 * d * d),
                     ("attn.c_attn.bias", 3 * d), ("attn.c_proj.weight", d * d),
                     ("attn.c_proj.bias", d), ("ln_2.weight", d), ("ln_2.bias", d),
                     ("mlp.c_fc.weight", 4 * d * d), ("mlp.c_fc.bias", 4 * d),
                     ("mlp.c_proj.weight", 4 * d * d), ("mlp.c_proj.bias", d)):
            t[p + n] = k
    t["transformer.ln_f.weight"] = d
    t["transformer.ln_f.bias"] = d
    return t


def with_adam(params: dict) -> dict:
    """fp32 weights and Adam's two moments: bytes by name."""
    out = {f"model.{k}": 4 * n for k, n in params.items()}
    for k, n in params.items():
        out[f"optim.state.{k}.exp_avg"] = 4 * n
        out[f"optim.state.{k}.exp_avg_sq"] = 4 * n
    return out


def loads(sizes: dict, writer_of, world: int) -> list:
    load = [0] * world
    for k, n in sizes.items():
        load[writer_of(k)] += n
    return load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also append the rows to this file (JSON lines)")
    args = ap.parse_args()
    rows = []
    for name, params in (("GPT-2 124M", gpt2(12, 768, 50257, 1024)),
                         ("Llama-2 7B", llama(32, 4096, 11008, 32000))):
        sizes = with_adam(params)
        total = sum(sizes.values())
        for world in (2, 4, 8, 16):
            mean = total / world
            balanced = _balanced_writers(list(sizes.items()), world)
            before = loads(sizes, lambda k: zlib.crc32(k.encode()) % world, world)
            after = loads(sizes, balanced.__getitem__, world)
            rows.append({"bench": "writer_balance", "state": name, "tensors": len(sizes),
                         "state_gb": round(total / 1e9, 2), "world": world,
                         "largest_tensor_gb": round(max(sizes.values()) / 1e9, 3),
                         "crc32_max_over_mean": round(max(before) / mean, 3),
                         "balanced_max_over_mean": round(max(after) / mean, 3)})
    print(f"{'state':<12} {'world':>5} {'by name hash':>13} {'balanced':>9}  (busiest rank's bytes / mean)")
    for r in rows:
        print(f"{r['state']:<12} {r['world']:>5} {r['crc32_max_over_mean']:>12.3f}x "
              f"{r['balanced_max_over_mean']:>8.3f}x")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
