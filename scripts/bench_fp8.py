"""FP8 block-scaled GEMMs (dsaflow.ops.fp8_gemm) at DeepSeek-V3.2 shapes, against torch's bf16 GEMMs (CUDA).

Dense, `fp8_linear` (activation quantization + GEMM, what a layer pays) for M rows (--rows, default 64, 256, 4096,
16384) at (N, K) = (24576, 1536) q_b, (576, 7168) kv_a, (7168, 16384) o_proj, (4096, 7168) a shared expert's
gate_up, (7168, 2048) its down; each kernel of the table that takes the shape (DSAFLOW_FP8_GEMM forces it), the
quantization kernel alone, and torch's bf16 matmul of the same shape. Then the projections that share one input
(the attention input's q_a, kv_a and indexer k; the MLP input's w1 and w3), each quantizing x against all reading
one `shared_fp8_input(x)`. Dense calls are timed as CUDA-graph replays, as serving runs them (no host launch gaps).
Grouped, `fp8_grouped_mm` over 256 experts with 8 per token (M = tokens x 8; --grouped-tokens, default 64, 512,
4096) for the routed experts' gate_up (4096 x 7168) and down (7168 x 2048), random uniform routing, each kernel that
takes the shape (the Gluon kernel above 64 rows per expert on sm_90, the Triton one everywhere), against torch's
bf16 grouped_mm (dsaflow.ops.moe.grouped_mm, DSAFLOW_MOE_GEMM=torch_grouped).

Rates: TFLOP/s (2 M N K) as a fraction of the fp8 ceiling (`torch._scaled_mm`, per-tensor scales, 8192^3) for the
fp8 rows and of the bf16 8192^3 matmul for the bf16 ones, both measured in this process; and the memory-bound view
that small M is in: the weight bytes a call must read (the touched experts' for grouped) per second, against the
device-to-device copy rate. Writes bench_fp8.json, bench_fp8.md and bench_fp8.png (with matplotlib) to --out.

    python scripts/bench_fp8.py --device cuda --out bench_out/fp8

`--sweep` times the Triton kernels' candidate tile configs instead and writes the winners as rows of their tables
(benches/fp8_sweep.py):

    python scripts/bench_fp8.py --device cuda --sweep --out bench_out/fp8_sweep
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from bench_lib import (
    CEIL,
    ROWS,
    bench,
    bench_graph,
    command_line,
    environment,
    fp8_ceiling,
    measure_ceilings,
    need_cuda,
    out_dir,
    record,
    user_error,
    write_results,
)

DENSE = {"q_b": (24576, 1536), "kv_a": (576, 7168), "o_proj": (7168, 16384), "shared gate_up": (4096, 7168),
         "shared down": (7168, 2048)}  # fmt: skip
# projections that read one input, timed as the layer runs them: each quantizing x, and reading shared_fp8_input(x)
SHARED = {"attention input (q_a, kv_a, indexer k)": ((1536, 7168), (576, 7168), (128, 7168)),
          "MLP input (shared w1, w3)": ((2048, 7168), (2048, 7168))}  # fmt: skip
GROUPED = {"experts gate_up": (4096, 7168), "experts down": (7168, 2048)}
EXPERTS, TOP_K = 256, 8
FP8_KERNELS = ("triton", "torch_scaled_mm")


def fp8_row(op, shape, M, impl, ms, flops, weight_bytes, **extra):
    """A row with its fraction of the fp8 ceiling (record's `frac_matmul` is the bf16 one) and its weight read rate."""
    row = record(op, impl, f"{shape} M={M}", ms, flops=flops, nbytes=weight_bytes, M=M, shape=shape, **extra)
    row["frac_fp8"] = round(row["tflops"] / CEIL["fp8_tflops"], 3)
    return row


def forced(kernel: str):
    os.environ["DSAFLOW_FP8_GEMM"] = kernel


def dense_rows(rows_list, skip: set) -> None:
    from dsaflow.ops.fp8_gemm import explain_fp8_gemm, fp8_linear, quantize_blocks_128
    from dsaflow.ops.fp8_gemm.triton_act_quant import quantize_rows_1x128_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    for op, (N, K) in DENSE.items():
        w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        w8, w_scale = quantize_blocks_128(w)
        shape = f"{N}x{K}"
        for M in rows_list:
            x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
            flops = 2 * M * N * K
            record(op, "torch bf16 matmul", f"{shape} M={M}", bench_graph(lambda: x @ w.t()), flops=flops,
                   nbytes=2 * N * K, M=M, shape=shape)  # fmt: skip
            for kernel in FP8_KERNELS:
                forced(kernel)
                choice = explain_fp8_gemm(x, w8)
                if choice.kernel != kernel:
                    skip.add(f"{kernel} at {op}: {dict(choice.refused)[kernel]}")
                    continue
                ms = bench_graph(lambda: fp8_linear(x, w8, w_scale))
                fp8_row(op, shape, M, f"fp8 {kernel}", ms, flops, N * K + w_scale.numel() * 4)
            forced("auto")
            ms = bench_graph(lambda: quantize_rows_1x128_triton(x))
            record(op, "quantize x (1x128)", f"{shape} M={M}", ms, nbytes=M * K * 3, M=M, shape=shape)
            del x
        del w, w8, w_scale
        torch.cuda.empty_cache()


def expert_weights(N: int, K: int, g):
    """fp8 [E, N, K] expert weights with their scales, quantized 16 experts at a time (a bf16 stack at once would
    need its fp32 copy), and a bf16 stack of the same shape for the baseline."""
    from dsaflow.ops.fp8_gemm import quantize_blocks_128

    w8 = torch.empty(EXPERTS, N, K, device="cuda", dtype=torch.float8_e4m3fn)
    w_scale = torch.empty(EXPERTS, -(-N // 128), -(-K // 128), device="cuda")
    for e in range(0, EXPERTS, 16):
        w8[e : e + 16], w_scale[e : e + 16] = quantize_blocks_128(
            torch.randn(16, N, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
        )
    w_bf16 = torch.randn(EXPERTS, N, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    return w8, w_scale, w_bf16


def shared_rows(rows_list) -> None:
    """Each SHARED group at M rows (the table's kernels): every projection quantizing x itself, then all reading
    `shared_fp8_input(x)`, which quantizes it once for all of them."""
    from dsaflow.ops.fp8_gemm import fp8_linear, quantize_blocks_128, shared_fp8_input

    g = torch.Generator(device="cuda").manual_seed(2)
    for op, shapes in SHARED.items():
        weights = [quantize_blocks_128(torch.randn(N, K, device="cuda", generator=g) * 0.02) for N, K in shapes]
        K = shapes[0][1]
        for M in rows_list:
            x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
            flops = sum(2 * M * N * K for N, _ in shapes)
            nbytes = sum(w8.numel() + 4 * s.numel() for w8, s in weights)

            def each():
                return [fp8_linear(x, *w) for w in weights]

            def once():
                x_fp8 = shared_fp8_input(x, *(w8 for w8, _ in weights))
                return [fp8_linear(x if x_fp8 is None else x_fp8, *w) for w in weights]

            for impl, fn in (("fp8, each quantizing x", each), ("fp8, shared_fp8_input(x)", once)):
                fp8_row(op, "+".join(f"{N}x{K}" for N, K in shapes), M, impl, bench_graph(fn), flops, nbytes)


def grouped_rows(tokens_list, skip: set) -> None:
    from dsaflow.ops.fp8_gemm import explain_fp8_gemm, fp8_grouped_mm
    from dsaflow.ops.moe import grouped_mm, sort_by_expert

    g = torch.Generator(device="cuda").manual_seed(1)
    os.environ["DSAFLOW_MOE_GEMM"] = "torch_grouped"
    for op, (N, K) in GROUPED.items():
        w8, w_scale, w_bf16 = expert_weights(N, K, g)
        shape = f"{N}x{K}"
        for tokens in tokens_list:
            M = tokens * TOP_K
            ids = torch.rand(tokens, EXPERTS, device="cuda", generator=g).topk(TOP_K, dim=-1).indices
            _, offsets = sort_by_expert(ids, EXPERTS)
            touched = int(torch.unique(ids).numel())
            a = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
            flops = 2 * M * N * K
            with torch.no_grad():
                ms = bench(lambda: grouped_mm(a, w_bf16, offsets))
            record(op, "torch bf16 grouped_mm", f"{shape} M={M}", ms, flops=flops, nbytes=2 * touched * N * K, M=M,
                   shape=shape, tokens=tokens, experts_read=touched)  # fmt: skip
            for kernel in ("gluon", *FP8_KERNELS):
                forced(kernel)
                choice = explain_fp8_gemm(a, w8, offsets)
                if choice.kernel != kernel:
                    skip.add(f"{kernel} at {op}: {dict(choice.refused)[kernel]}")
                    continue
                ms = bench(lambda: fp8_grouped_mm(a, w8, w_scale, offsets))
                fp8_row(op, shape, M, f"fp8 {kernel}", ms, flops, touched * (N * K + w_scale[0].numel() * 4),
                        tokens=tokens, experts_read=touched)  # fmt: skip
            del a
        del w8, w_scale, w_bf16
        torch.cuda.empty_cache()


def table(rows: list, skip: set, env: dict) -> str:
    lines = [
        f"FP8 block-scaled GEMMs on {env['device_name']} (torch {env['torch']}, triton {env.get('triton', '-')}; "
        f"`{env['command']}`). Ceilings in this process: fp8 {CEIL['fp8_tflops']} TFLOP/s (`torch._scaled_mm` "
        f"8192^3), bf16 {CEIL['matmul_tflops']} TFLOP/s, copy {CEIL['copy_tbps']} TB/s.",
        "",
        "GB/s: the weights a call reads (the quantize rows: x read and x8 written), against the copy rate.",
        "",
        "| op | N x K | M | impl | ms | TFLOP/s | of its ceiling | GB/s | of copy |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        tf = f"{r['tflops']:.0f}" if "tflops" in r else ""
        frac = r.get("frac_fp8", r.get("frac_matmul"))
        of = f"{100 * frac:.0f} %" if frac is not None else ""
        gbs = f"{r['tbps'] * 1000:.0f}" if "tbps" in r else ""
        oc = f"{100 * r['frac_copy']:.0f} %" if "frac_copy" in r else ""
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['M']} | {r['impl']} | {r['time_ms']:.4f} | {tf} | {of} | "
                     f"{gbs} | {oc} |")  # fmt: skip
    if skip:
        lines += ["", "Not run (the kernel's rule refuses): " + "; ".join(sorted(skip)) + "."]
    return "\n".join(lines)


def plot(rows: list):
    def draw(plt):
        ops = list(DENSE) + list(GROUPED) + list(SHARED)
        fig, axes = plt.subplots(3, 3, figsize=(15, 12))
        for ax, op in zip(axes.flat, ops):
            mine = [r for r in rows if r["kernel"] == op and "tflops" in r]
            for impl in dict.fromkeys(r["impl"] for r in mine):
                pts = sorted((r["M"], r["tflops"]) for r in mine if r["impl"] == impl)
                ax.plot(*zip(*pts), marker="o", label=impl)
            ax.axhline(CEIL["fp8_tflops"], ls="--", c="gray", lw=0.8)
            ax.axhline(CEIL["matmul_tflops"], ls=":", c="gray", lw=0.8)
            ax.set(xscale="log", title=op, xlabel="M (rows)", ylabel="TFLOP/s")
            ax.legend(fontsize=7)
        fig.tight_layout()
        return fig

    return draw


def main(argv=None, prog: str = "bench_fp8.py") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda"], help="the kernels are CUDA's")
    p.add_argument("--rows", default="64,256,4096,16384", help="M of the dense GEMMs")
    p.add_argument("--grouped-tokens", default="64,512,4096", help="tokens of the grouped GEMMs (M = tokens x 8)")
    p.add_argument("--out", default="bench_out/fp8", help="folder for bench_fp8.json, .md and .png")
    p.add_argument("--sweep", action="store_true", help="time the candidate tile configs (benches/fp8_sweep.py)")
    args = p.parse_args(argv)
    need_cuda(prog)  # --device auto or cuda: either way the kernels are CUDA's
    if args.sweep:
        from benches.fp8_sweep import run_sweep

        return run_sweep(out_dir(prog, args.out), command_line(prog, argv))
    try:
        rows_list = [int(v) for v in args.rows.split(",")]
        tokens_list = [int(v) for v in args.grouped_tokens.split(",")] if args.grouped_tokens else []
    except ValueError:
        user_error(prog, "--rows and --grouped-tokens take comma-separated integers")
    out = out_dir(prog, args.out)
    measure_ceilings()
    CEIL["fp8_tflops"] = fp8_ceiling()
    print("fp8 ceiling", CEIL["fp8_tflops"], "TFLOP/s", flush=True)
    skip: set = set()
    dense_rows(rows_list, skip)
    shared_rows(rows_list)
    grouped_rows(tokens_list, skip)
    env = environment(command=command_line(prog, argv))
    data = {"environment": env, "ceilings": CEIL, "not_run": sorted(skip), "rows": ROWS}
    write_results(out, "bench_fp8", data, table(ROWS, skip, env), plot(ROWS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
