#!/usr/bin/env python3
"""Train a small GPT with AdamW on CPU and write its full training state at chosen steps as
safetensors files, for ``ckpt-bench delta --trajectory DIR`` (issue 16: what delta chunks
store on a real training trajectory).

The model is ``tiny_gpt.TinyGPT`` at a larger size (default d=512, 4 layers, about 13M
parameters), byte-level, trained on a text corpus (default: the Python standard library's
sources, several MB, so a 13M model does not merely memorise it). Training is mixed precision
as large-model runs do it: fp32 master weights, a bf16 forward (``torch.autocast``), AdamW
(betas 0.9/0.95, weight decay 0.1, lr warmed up linearly to ``--lr``, 3e-4 by default as in
LLM pre-training). Each file ``step-NNNNNN.safetensors`` holds, per parameter ``P``:

    P              bf16 copy of the weights (what a bf16 forward reads)
    P.master       fp32 master weights
    P.exp_avg      fp32 Adam first moment
    P.exp_avg_sq   fp32 Adam second moment

which are the reference workload's names, so the bench sorts them into the same kinds.

    python python/examples/delta_trajectory.py --out bench-out/traj --warmup 50 \\
        --save 50,51,52,60,70,150,250
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_gpt import TinyGPT  # noqa: E402


def corpus(path: Path | None, limit: int) -> torch.Tensor:
    """Bytes of the training text: `path`, or the standard library's .py files."""
    if path is not None:
        data = path.read_bytes()[:limit]
    else:
        root = Path(sysconfig.get_paths()["stdlib"])
        parts, n = [], 0
        for f in sorted(root.glob("*.py")):
            b = f.read_bytes()
            parts.append(b)
            n += len(b)
            if n >= limit:
                break
        data = b"".join(parts)[:limit]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--save", default="50,51,52,60,70,150,250",
                   help="steps whose state is written (comma separated)")
    p.add_argument("--warmup", type=int, default=50, help="steps of linear lr warm-up")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--corpus", type=Path, default=None)
    p.add_argument("--corpus-bytes", type=int, default=8 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    saves = sorted({int(s) for s in args.save.split(",")})
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    data = corpus(args.corpus, args.corpus_bytes)
    model = TinyGPT(256, args.context, args.d_model, args.layers, args.heads, dropout=0.0)
    for name, w in model.named_parameters():
        if w.dim() >= 2:
            torch.nn.init.normal_(w, std=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    nparams = sum(w.numel() for w in model.parameters())
    print(f"{nparams} parameters, corpus {len(data)} bytes, saves at {saves}", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    for step in range(1, saves[-1] + 1):
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, step / max(1, args.warmup))
        starts = torch.randint(0, len(data) - args.context - 1, (args.batch,), generator=gen)
        x = torch.stack([data[s:s + args.context] for s in starts])
        y = torch.stack([data[s + 1:s + 1 + args.context] for s in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, 256), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0 or step in saves:
            print(f"step {step} loss {loss.item():.4f} ({time.time() - t0:.0f} s)", flush=True)
        if step in saves:
            out = {}
            for name, w in model.named_parameters():
                st = opt.state[w]
                out[name] = w.detach().to(torch.bfloat16).contiguous()
                out[name + ".master"] = w.detach().clone().contiguous()
                out[name + ".exp_avg"] = st["exp_avg"].detach().clone().contiguous()
                out[name + ".exp_avg_sq"] = st["exp_avg_sq"].detach().clone().contiguous()
            tmp = args.out / f".step-{step:06d}.tmp"
            save_file(out, str(tmp), metadata={"step": str(step), "lr": str(args.lr)})
            os.replace(tmp, args.out / f"step-{step:06d}.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
