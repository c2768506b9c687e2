"""The indexer top-k's radix select (the dispatcher's path on CUDA) against torch.topk on the same logits, over key
counts, decode, causal prefill and serving-pass shapes.

    python3 scripts/bench_topk.py select --out bench_out/topk_select        # one GPU, about a minute

Cases (B rows x T queries over S keys, positions ending at the last key ("full") or at S/2 ("half": a serving cache
filled halfway)): decode64 / decode64_half / decode8 (T = 1), prefill1x2048 (one causal 2048-query chunk at the end),
serve64x256 / serve64x32 (a serving pass of 64 rows). Two indexers: 8 heads x 64 with top-256 (`model=small`) and
64 heads x 128 with top-2048 (DeepSeek-V3.2). Both must select keys of the same scores (checked per case; torch.topk
orders tied scores as it likes, the op takes the lower key index). Writes topk_select.json and topk_select.md.
"""

from __future__ import annotations

import argparse

import torch
from bench_lib import environment, need_cuda, out_dir, timed_slow, write_results

from dsaflow.ops.indexer_topk.budget import query_chunk
from dsaflow.ops.indexer_topk.naive import ascending_keys
from dsaflow.ops.indexer_topk.triton_indexer import indexer_logits_triton, indexer_topk_triton, quantize_rows_triton

CASES = (
    ("decode64", 64, 1, "full"),
    ("decode64_half", 64, 1, "half"),
    ("decode8", 8, 1, "full"),
    ("prefill1x2048", 1, 2048, "full"),
    ("serve64x256", 64, 256, "half"),
    ("serve64x32", 64, 32, "half"),
)
INDEXERS = ((8, 64, 256), (64, 128, 2048))  # heads, head dim, top-k


def indexer_logits(q, k, w, positions, fp8: bool = False) -> torch.Tensor:
    """The op's fp32 logits: q [B, T, H, D], k [B, S, D], w [B, T, H], positions [B, T] -> [B, T, S], -inf where a
    key is invisible; with fp8, from q and k rounded to fp8 as the op's fp8 path rounds them."""
    if not fp8:
        return indexer_logits_triton(q, k, w, positions)
    q8, _, w_scaled = quantize_rows_triton(q, w)
    k8, k_scale = quantize_rows_triton(k)
    return indexer_logits_triton(q8, k8, w_scaled, positions, k_scale=k_scale)


@torch.no_grad()
def torch_topk_indexer(q, k, w, positions, topk: int, fp8: bool = False) -> torch.Tensor:
    """The baseline: the op's contract with torch.topk as its select. The op's logits per query chunk (its chunks),
    torch.topk of each row, the selected keys in ascending order with -1 for invisible ones, as the op returns them:
    q [B, T, H, D], k [B, S, D], w [B, T, H], positions [B, T] -> int32 [B, T, topk]."""
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    out = torch.empty(B, T, topk, device=q.device, dtype=torch.int32)
    chunk = query_chunk(B, T, S)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        out[:, t0:t1] = torch_topk_select(indexer_logits(q[:, t0:t1], k, w[:, t0:t1], positions[:, t0:t1], fp8), topk)
    return out


def torch_topk_select(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """torch.topk as the select alone: scores fp32 [B, T, S] (-inf = invisible) -> int32 [B, T, topk], the selected
    keys in ascending order, -1 for invisible ones and after all S keys when S < topk."""
    vals, idx = scores.topk(min(topk, scores.shape[-1]), dim=-1, sorted=False)
    idx = ascending_keys(torch.where(vals == float("-inf"), -1, idx).to(torch.int32))
    return torch.nn.functional.pad(idx, (0, topk - idx.shape[-1]), value=-1)


def same_selection(got: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor) -> bool:
    """Whether two selections int32 [B, T, topk] (-1 = none) take keys of the same scores in every row of scores
    [B, T, S]: the same set up to which of several tied keys each took."""

    def taken(idx):
        vals = scores.gather(-1, idx.long().clamp(min=0)).masked_fill(idx < 0, float("-inf"))
        return vals.sort(dim=-1, descending=True).values

    return torch.equal(taken(got), taken(ref))


def main(argv=None, prog: str = "bench_topk.py select") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="1025,2049,4097,4353,8193,16385")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench_out/topk_select")
    a = ap.parse_args(argv)
    need_cuda(prog)
    out = out_dir(prog, a.out)
    dev = torch.device("cuda")
    rows = []
    for H, D, K in INDEXERS:
        for S in (int(x) for x in a.keys.split(",")):
            for name, B, T, visible in CASES:
                if K >= S or T > S:
                    continue
                q = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
                k = torch.randn(B, S, D, device=dev, dtype=torch.bfloat16)
                w = torch.randn(B, T, H, device=dev)
                end = S - 1 if visible == "full" else S // 2
                pos = (end - T + 1 + torch.arange(T, device=dev)).expand(B, T).contiguous()
                r = {"heads": H, "topk": K, "keys": S, "case": name}
                for select, op in (("radix", indexer_topk_triton), ("torch_topk", torch_topk_indexer)):
                    r[f"{select}_ms"] = timed_slow(lambda op=op: op(q, k, w, pos, K), a.reps)
                radix, baseline = indexer_topk_triton(q, k, w, pos, K), torch_topk_indexer(q, k, w, pos, K)
                r["same_selection"] = same_selection(radix, baseline, indexer_logits(q, k, w, pos))
                r["torch_topk_over_radix"] = r["torch_topk_ms"] / r["radix_ms"]
                rows.append(r)
                print(r, flush=True)
    e = environment()
    env = f"{e['device_name']}, torch {e['torch']}"
    md = [f"# Indexer top-k: radix select vs torch.topk\n\n{env}. `python3 scripts/bench_topk.py select`.\n"]
    md += [
        "| heads x top-k | keys | case | radix ms | torch.topk ms | torch.topk / radix | same selection |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    md += [
        f"| {r['heads']} x {r['topk']} | {r['keys']} | {r['case']} | {r['radix_ms']:.3f} | {r['torch_topk_ms']:.3f} | "
        f"{r['torch_topk_over_radix']:.2f} | {r['same_selection']} |"
        for r in rows
    ]
    wins = sum(r["radix_ms"] <= r["torch_topk_ms"] for r in rows)
    md.append(f"\nradix faster or equal in {wins} of {len(rows)} cases.")
    write_results(out, "topk_select", {"device": env, "rows": rows}, "\n".join(md))
    return 0 if all(r["same_selection"] for r in rows) else 1
