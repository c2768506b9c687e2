"""The indexer top-k's two Triton selects side by side: the radix select (the dispatcher's path on CUDA) against
int64 sort keys + torch.topk (`topk_sort_baseline.py`), over key counts, decode, causal prefill and serving-pass shapes.

    python3 scripts/bench_topk.py select --out bench_out/topk_select        # one GPU, about a minute

Cases (B rows x T queries over S keys, positions ending at the last key ("full") or at S/2 ("half": a serving cache
filled halfway)): decode64 / decode64_half / decode8 (T = 1), prefill1x2048 (one causal 2048-query chunk at the end),
serve64x256 / serve64x32 (a serving pass of 64 rows). Two indexers: 8 heads x 64 with top-256 (`model=small`) and
64 heads x 128 with top-2048 (DeepSeek-V3.2). Both selects must return identical indices (checked per case).
Writes topk_select.json and topk_select.md.
"""

from __future__ import annotations

import argparse

import torch
from bench_lib import environment, need_cuda, out_dir, timed_slow, write_results
from topk_sort_baseline import indexer_topk_sort

from dsaflow.ops.indexer_topk.triton_indexer import indexer_topk_triton

CASES = (
    ("decode64", 64, 1, "full"),
    ("decode64_half", 64, 1, "half"),
    ("decode8", 8, 1, "full"),
    ("prefill1x2048", 1, 2048, "full"),
    ("serve64x256", 64, 256, "half"),
    ("serve64x32", 64, 32, "half"),
)
INDEXERS = ((8, 64, 256), (64, 128, 2048))  # heads, head dim, top-k


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
                for select, op in (("radix", indexer_topk_triton), ("sort", indexer_topk_sort)):
                    r[f"{select}_ms"] = timed_slow(lambda op=op: op(q, k, w, pos, K), a.reps)
                radix = indexer_topk_triton(q, k, w, pos, K)
                r["identical"] = bool(torch.equal(radix, indexer_topk_sort(q, k, w, pos, K)))
                r["sort_over_radix"] = r["sort_ms"] / r["radix_ms"]
                rows.append(r)
                print(r, flush=True)
    e = environment()
    env = f"{e['device_name']}, torch {e['torch']}"
    md = [f"# Indexer top-k: radix select vs torch.topk\n\n{env}. `python3 scripts/bench_topk.py select`.\n"]
    md += [
        "| heads x top-k | keys | case | radix ms | sort ms | sort / radix | identical |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    md += [
        f"| {r['heads']} x {r['topk']} | {r['keys']} | {r['case']} | {r['radix_ms']:.3f} | {r['sort_ms']:.3f} | "
        f"{r['sort_over_radix']:.2f} | {r['identical']} |"
        for r in rows
    ]
    wins = sum(r["radix_ms"] <= r["sort_ms"] for r in rows)
    md.append(f"\nradix faster or equal in {wins} of {len(rows)} cases.")
    write_results(out, "topk_select", {"device": env, "rows": rows}, "\n".join(md))
    return 0 if all(r["identical"] for r in rows) else 1
