"""Profile one training step of a stage module on one GPU (no pipeline): wall time per variant + top CUDA kernels.

Usage: python scripts/profile_step.py [overrides...]   (default model=small, train.seq_len=512, batch 2 x 4 microbatches)
Prints per-variant ms (sparse with/without indexer loss, dense) and a torch.profiler table of the slowest ops.
"""

from __future__ import annotations

import sys
import time

import torch

from dsaflow.config.compose import compose
from dsaflow.model import IndexerLossInBackward
from dsaflow.pipeline.stages import stage_module
from dsaflow.plan import build_plan


def main(argv):
    cfg = compose(["model=small", "train.seq_len=512", *argv])
    plan = build_plan(cfg)
    dev = torch.device("cuda")
    m = stage_module(cfg.model, plan, 0).to(dev).train()
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len), device=dev)

    def step(attn="sparse", ind=True):
        # the trainer's path: the sparse indexer loss runs inside the backward
        sink = IndexerLossInBackward(1.0) if ind and attn == "sparse" else None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(x, attn=attn, compute_indexer_loss=ind, indexer_loss_in_backward=sink)
        out.float().logsumexp(-1).mean().backward()
        if ind and m.indexer_loss is not None:
            m.indexer_loss.backward()

    for name, kw in [
        ("sparse+indexer_loss", {}),
        ("sparse", {"ind": False}),
        ("dense", {"attn": "dense", "ind": False}),
    ]:
        for _ in range(3):
            step(**kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            step(**kw)
        torch.cuda.synchronize()
        print(f"{name:22s} {1e3 * (time.perf_counter() - t0) / 5:8.2f} ms / microbatch fwd+bwd", flush=True)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        step()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
    print(p.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main(sys.argv[1:])
