"""The training step's glue ops at DeepSeek-V3.2 attention shapes, new kernels vs the torch code they replace (CUDA).

One sequence of --seq tokens (default 4096); forward + backward of each op (do_bench median, the gradient of the output
is a fixed random tensor):
  rms_norm      [T, 7168] fp32 (the block norms) and [T, 1536] bf16 (the q latent norm): Triton vs the fp32 torch code
  rope          q_pe, a [T, 128, 64] slice of q [T, 128, 192] bf16: Triton vs the torch code
  absorb_query  q [T, 128, 192] x W_UK [128, 128, 512] -> q_abs [T, 128, 576] bf16: strided bmm's vs einsum + cat
  head_output   o_lat [T, 128, 512] x W_UV [128, 128, 512] -> [T, 16384] bf16: strided bmm's vs einsum + reshape
  head_tensors  serving prefill, forward only: the non-absorbed q, k, v [128, T, 192 / 192 / 128] from q and T cached
                latent rows [T, 576] (dsaflow.model.dense_prefill: q_pe rotated in place, batched up-projections
                into strided buffers) vs one W_UKV GEMM and strided copies
Rates: memory-bound ops in GB/s of the bytes they must move (inputs read + outputs written, forward and backward)
against a device-to-device copy measured in the same process; projections in TFLOP/s of their three matmuls against
a bf16 8192^3 matmul. Writes <out>/bench_glue.json and <out>/bench_glue.md.

    python scripts/bench_glue.py --out bench_out
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_lib import bench, describe_device, measure_ceilings, need_cuda, out_dir, write_results

DEV = "cuda"


def do_bench(fn) -> float:
    """Median ms on CUDA; on CPU (--smoke) one call, which checks the script's logic only."""
    return bench(fn, rep_ms=200, warmup_ms=25, device=DEV)


def ceilings() -> dict:
    ceil = measure_ceilings(DEV)
    return {"copy_gb_s": ceil["copy_tbps"] * 1e3, "matmul_tflops": ceil["matmul_tflops"]}


def fwd_bwd(f, inputs, dy):
    def run():
        torch.autograd.grad(f(*inputs), [t for t in inputs if t.requires_grad], dy)

    return run


def cases(T: int):
    from dsaflow.model.rope import rope_angles
    from dsaflow.ops.head_proj import absorb_query, absorb_query_naive, head_output, head_output_naive
    from dsaflow.ops.rmsnorm import rms_norm, rms_norm_naive
    from dsaflow.ops.rope import rope, rope_naive

    g = torch.Generator(device=DEV).manual_seed(0)
    H, N, R, C, V = 128, 128, 64, 512, 128

    def rnd(*shape, dtype=torch.bfloat16, grad=True):
        return torch.randn(*shape, device=DEV, generator=g).to(dtype).requires_grad_(grad)

    cos, sin = rope_angles(torch.arange(T, device=DEV).unsqueeze(0), R, 10000.0)
    for D, dt in ((7168, torch.float32), (1536, torch.bfloat16)):
        x, w = rnd(1, T, D, dtype=dt), rnd(D, dtype=torch.float32)
        nbytes = 5 * x.numel() * x.element_size()  # fwd: x in, y out; bwd: x, dy in, dx out
        dy = rnd(1, T, D, dtype=dt, grad=False)
        yield (
            f"rms_norm [T, {D}] {str(dt)[6:]}",
            fwd_bwd(lambda a, b: rms_norm(a, b, 1e-6), (x, w), dy),
            fwd_bwd(lambda a, b: rms_norm_naive(a, b, 1e-6), (x, w), dy),
            nbytes,
            None,
        )
    q = rnd(1, T, H, N + R)
    q_pe = q[..., N:]
    dy = rnd(1, T, H, R, grad=False)
    yield (
        "rope q_pe [T, 128, 64] bf16",
        fwd_bwd(lambda a: rope(a, cos, sin), (q_pe,), dy),
        fwd_bwd(lambda a: rope_naive(a, cos, sin), (q_pe,), dy),
        4 * q_pe.numel() * 2,
        None,
    )
    w = rnd(H, N + V, C, grad=False) * C**-0.5
    w_uk, w_uv = w[:, :N].detach().requires_grad_(True), w[:, N:].detach().requires_grad_(True)
    dy = rnd(1, T, H, C + R, grad=False)
    yield (
        "absorb_query -> [T, 128, 576] bf16",
        fwd_bwd(lambda a, b: absorb_query(a, b, cos, sin), (q, w_uk), dy),
        fwd_bwd(lambda a, b: absorb_query_naive(a, b, cos, sin), (q, w_uk), dy),
        None,
        3 * 2 * T * H * N * C,
    )
    o_lat = rnd(1, T, H, C)
    dy = rnd(1, T, H * V, grad=False)
    yield (
        "head_output -> [T, 16384] bf16",
        fwd_bwd(head_output, (o_lat, w_uv), dy),
        fwd_bwd(head_output_naive, (o_lat, w_uv), dy),
        None,
        3 * 2 * T * H * V * C,
    )
    yield ("head_tensors (forward) -> q, k, v bf16", *serving_head_tensors(T, cos, sin, w, rnd))


def serving_head_tensors(T: int, cos, sin, w, rnd):
    """dense_prefill.head_tensors (after the in-place q_pe rotation) and the GEMM + copies it replaced, at T tokens
    over T cached rows: (new, torch, None, FLOPs of the two up-projections)."""
    from types import SimpleNamespace

    from dsaflow.model.dense_prefill import head_tensors, rotate_query_pe_
    from dsaflow.ops.rope import rope

    H, NV, C = w.shape
    N, R, V = 128, 64, NV - 128
    mla = SimpleNamespace(nope=N, rope=R, v_dim=V, kv_lora_rank=C, wkv_b=SimpleNamespace(weight=w.reshape(H * NV, C)))
    q, kv = rnd(1, T, H, N + R, grad=False), rnd(1, T, C + R, grad=False)

    def new():
        return head_tensors(mla, rotate_query_pe_(q, cos, sin, N), kv)

    def copies():
        kvb = (kv[..., :C] @ mla.wkv_b.weight.t()).view(1, T, H, N + V)
        qh, kh = q.new_empty(1, T, H, N + R), q.new_empty(1, T, H, N + R)
        qh[..., :N].copy_(q[..., :N])
        qh[..., N:].copy_(rope(q[..., N:], cos, sin))
        kh[..., :N].copy_(kvb[..., :N])
        kh[..., N:].copy_(kv[..., C:].unsqueeze(2))
        return qh.transpose(1, 2), kh.transpose(1, 2), kvb[..., N:].transpose(1, 2)

    return torch.no_grad()(new), torch.no_grad()(copies), None, 2 * T * C * H * (N + V)


def main(argv=None, prog: str = "bench_glue.py") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--smoke", action="store_true", help="CPU, 16 tokens: the script's logic only")
    args = ap.parse_args(argv)
    if args.smoke:
        global DEV
        DEV, args.seq = "cpu", 16
    else:
        need_cuda(prog)
    out = out_dir(prog, args.out)
    ceil = ceilings()
    rows = []
    for name, new, ref, nbytes, flops in cases(args.seq):
        new_ms, ref_ms = do_bench(new), do_bench(ref)
        row = {"op": name, "new_ms": new_ms, "torch_ms": ref_ms, "speedup": ref_ms / new_ms}
        if nbytes:
            row.update(gb_s=nbytes / new_ms / 1e6, of_copy=nbytes / new_ms / 1e6 / ceil["copy_gb_s"])
        if flops:
            row.update(tflops=flops / new_ms / 1e9, of_matmul=flops / new_ms / 1e9 / ceil["matmul_tflops"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"device": describe_device(DEV), "seq": args.seq, **ceil}
    lines = [
        f"{meta['device']}, T = {args.seq}: copy {ceil['copy_gb_s']:.0f} GB/s, bf16 matmul "
        f"{ceil['matmul_tflops']:.0f} TFLOP/s (same process). Forward + backward (head_tensors: forward), ms:",
        "",
        "| op | new | torch | speedup | rate | of ceiling |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rate = f"{r['gb_s']:.0f} GB/s" if "gb_s" in r else f"{r['tflops']:.0f} TFLOP/s"
        frac = r.get("of_copy", r.get("of_matmul"))
        lines.append(
            f"| {r['op']} | {r['new_ms']:.3f} | {r['torch_ms']:.3f} | {r['speedup']:.2f}x | {rate} | "
            f"{100 * frac:.0f} % |"
        )
    write_results(out, "bench_glue", {**meta, "rows": rows}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
