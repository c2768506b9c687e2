"""MoE layer benchmark at DeepSeek-V3.2 expert shapes (7168 -> 2048, 256 experts, 8 per token, one shared expert).

Training (`--tokens`): forward + backward of dsaflow's MoE MLP (router, routed experts through each grouped-GEMM
kernel, shared expert), timed against, in the same process:
  dense     a plain-torch SwiGLU of width (k + shared) * 2048 = 18432 over the same tokens: the same active FLOPs
            (less the router's), the bar the grouped GEMMs are measured against;
  loop      the routed experts one at a time (index, two matmuls, index_add), as transformers' reference runs them.
Active FLOPs = 3 x 2 x (router E*D + (k + shared) * 3 * I * D) per token (forward + backward).

Decode (`--decode-rows`): one forward of the MoE MLP over a decode pass of that many rows; the bytes are the
weights it must read (every expert some row chose, the shared expert, the router), against the copy bandwidth
measured in the same process.

Routing is random and uniform (a random fp32 gate over random inputs), plus one skewed row per size (half of the
tokens' first choice on 16 experts) for the training sizes. Writes bench_moe.json and bench_moe.md to --out.

    python scripts/bench_moe.py --out bench_out/moe               # on a GPU; about 2 minutes on one H100
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from bench_lib import (
    CEIL,
    bench,
    describe_device,
    kernel_times,
    measure_ceilings,
    need_cuda,
    out_dir,
    timed_slow,
    write_results,
)

from dsaflow.config.moe_schema import MoEConfig
from dsaflow.model.moe import MoE
from dsaflow.model.swiglu import SwiGLU
from dsaflow.ops.moe import dispatch

D, I, E, K = 7168, 2048, 256, 8


def moe_layer(kernel: str, skew: bool) -> MoE:
    """A bf16 MoE layer built on the GPU (22.5 GB of experts: never through fp32 or the host)."""
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            layer = MoE(
                D, MoEConfig(n_routed_experts=E, num_experts_per_tok=K, moe_inter_dim=I, n_group=8, topk_group=4)
            )
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.02)
        layer.experts.gate_up_proj.normal_(0, 0.006)
        layer.experts.down_proj.normal_(0, 0.006)
        if skew:  # experts 0-15 win every token's first choice: half of the rows on 16 experts
            layer.gate.e_score_correction_bias[:16] = 1.0
    os.environ[dispatch.ENV_KERNEL] = kernel  # this layer's grouped GEMMs (read at each call)
    return layer


def active_flops(tokens: int) -> int:
    return 2 * tokens * (E * D + (K + 1) * 3 * I * D)


def loop_experts(x, ids, weights, gate_up, down):
    """transformers' reference order: one expert at a time (host syncs to find each expert's tokens)."""
    out = torch.zeros_like(x)
    for e in range(E):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        g, u = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e]) * weights[token, slot, None].to(x.dtype)
        out.index_add_(0, token, y)
    return out


def profile_step(tokens: int, kernel: str) -> None:
    """Print the 15 costliest CUDA kernels of one forward + backward of `tokens` tokens: where a step goes."""
    layer = moe_layer(kernel, False)
    x = torch.randn(1, tokens, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    step = lambda: layer(x).backward(grad)  # noqa: E731
    step()
    for name, ms, calls in kernel_times(step, "cuda")[:15]:
        print(f"{ms:9.3f} ms {calls:6.0f} calls  {name}", flush=True)


def train_rows(tokens: int, kernels, skew: bool, loop: bool) -> list[dict]:
    rows = []
    x = torch.randn(1, tokens, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, tokens, D, device="cuda", dtype=torch.bfloat16)
    flops = 3 * active_flops(tokens)
    for kernel in kernels:
        layer = moe_layer(kernel, skew)

        def step():
            layer.zero_grad(set_to_none=True)
            layer(x).backward(grad)

        ms = bench(step, rep_ms=300)
        rows.append(dict(tokens=tokens, impl=f"dsaflow MoE ({kernel})", skew=skew, ms=ms, flops=flops))
        del layer
        torch.cuda.empty_cache()
    if skew:
        return rows
    dense = SwiGLU(D, (K + 1) * I).cuda().to(torch.bfloat16)

    def dense_step():
        dense.zero_grad(set_to_none=True)
        dense(x).backward(grad)

    ms = bench(dense_step, rep_ms=300)
    rows.append(dict(tokens=tokens, impl="dense SwiGLU 18432 (same FLOPs)", skew=False, ms=ms, flops=flops))
    del dense
    layer = moe_layer(kernels[0], False)

    def loop_step():
        layer.zero_grad(set_to_none=True)
        flat = x.view(tokens, D)
        ids, w, _ = layer.gate(flat)
        out = loop_experts(flat, ids, w, layer.experts.gate_up_proj, layer.experts.down_proj)
        (out + layer.shared_experts(flat)).backward(grad.view(tokens, D))

    if loop:  # seconds a step: timed at the first size only
        ms = timed_slow(loop_step)
        rows.append(dict(tokens=tokens, impl="per-expert loop", skew=False, ms=ms, flops=flops))
    return rows


def decode_rows(rows_n: int, kernels) -> list[dict]:
    out = []
    x = torch.randn(rows_n, 1, D, device="cuda", dtype=torch.bfloat16)
    for kernel in kernels:
        layer = moe_layer(kernel, False)
        with torch.no_grad():
            ids, _, _ = layer.gate(x.view(rows_n, D))
            touched = int(torch.unique(ids).numel())
            nbytes = (touched + 1) * 3 * I * D * 2 + E * D * 4
            ms = bench(lambda: layer(x), rep_ms=200)
        out.append(dict(tokens=rows_n, impl=f"decode ({kernel})", experts_read=touched, ms=ms, bytes=nbytes))
        del layer
        torch.cuda.empty_cache()
    return out


def main(argv=None, prog: str = "bench_moe.py") -> int:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--tokens", default="4096,16384,32768", help="tokens per microbatch for forward + backward")
    p.add_argument("--decode-rows", default="64,256", help="rows per decode pass")
    p.add_argument("--kernels", default="torch_grouped,triton", help="grouped GEMMs to time (dispatch.py names)")
    p.add_argument("--out", default="bench_out/moe", help="folder for bench_moe.json and bench_moe.md")
    p.add_argument("--profile", type=int, default=0, help="print the costliest kernels of a step of this many tokens")
    args = p.parse_args(argv)
    need_cuda(prog)
    kernels = args.kernels.split(",")
    out = out_dir(prog, args.out)
    measure_ceilings()
    if args.profile:
        profile_step(args.profile, kernels[0])
    rows = []
    for n, t in enumerate(map(int, args.tokens.split(","))):
        for skew in (False, True):
            try:
                timed = train_rows(t, kernels, skew, loop=n == 0)
            except torch.OutOfMemoryError:
                print(f"{prog}: {t} tokens (skew={skew}) do not fit in this GPU's memory; row skipped", flush=True)
                torch.cuda.empty_cache()
                continue
            for r in timed:
                r["tflops"] = r["flops"] / r["ms"] / 1e9
                print(json.dumps(r), flush=True)
                rows.append(r)
    for n in map(int, args.decode_rows.split(",")):
        for r in decode_rows(n, kernels):
            r["tbps"] = r["bytes"] / r["ms"] / 1e9
            r["frac_copy"] = r["tbps"] / CEIL["copy_tbps"]
            print(json.dumps(r), flush=True)
            rows.append(r)
    dense = {r["tokens"]: r["tflops"] for r in rows if r["impl"].startswith("dense")}
    for r in rows:
        if "tflops" in r:
            r["frac_matmul"] = r["tflops"] / CEIL["matmul_tflops"]
            r["vs_dense"] = r["tflops"] / dense[r["tokens"]] if r["tokens"] in dense else None
    device = describe_device()
    lines = [
        f"MoE MLP at DeepSeek-V3.2 expert shapes on {device} (`python scripts/bench_moe.py`); ceilings: bf16 matmul "
        f"{CEIL['matmul_tflops']} TFLOP/s, copy {CEIL['copy_tbps']} TB/s",
        "",
        "| tokens | impl | skewed | ms | active TFLOP/s | of matmul | of dense | GB/s (decode) | of copy |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        tf = f"{r['tflops']:.0f}" if "tflops" in r else ""
        fm = f"{r['frac_matmul']:.2f}" if "frac_matmul" in r else ""
        vd = f"{r['vs_dense']:.2f}" if r.get("vs_dense") else ""
        bw = f"{r['tbps'] * 1000:.0f}" if "tbps" in r else ""
        fc = f"{r['frac_copy']:.2f}" if "frac_copy" in r else ""
        lines.append(
            f"| {r['tokens']} | {r['impl']} | {'yes' if r.get('skew') else ''} | {r['ms']:.2f} | {tf} | {fm} | {vd} "
            f"| {bw} | {fc} |"
        )
    write_results(out, "bench_moe", {"device": device, "ceilings": CEIL, "rows": rows}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
