"""cuDNN-Frontend's sparse-attention backward beside dsaflow's (`python scripts/bench_ops.py --only peers`): the same
inputs in one process, with and without the indexer-loss target; rows go to `PEERS` and to bench_lib's table."""

from __future__ import annotations

import json
import os

import torch
from bench_lib import D_QK, D_V, TOPK, H, bench, mla_inputs, record, rel_err, sweep

from dsaflow.ops.sparse_mla.hopper_backward import hopper_bwd_supports
from dsaflow.ops.sparse_mla.triton_backward import sparse_mla_bwd_triton
from dsaflow.ops.sparse_mla.triton_prefill import key_extent, sparse_mla_fwd_triton
from dsaflow.ops.sparse_mla.triton_probs import sparse_mla_probs_triton

PEERS: list[dict] = []  # side-by-side backward rows: one per shape, both libraries
PROBS_SWEEP = [  # target-pass tiles tried (overrides of `triton_probs.probs_config`; {} = its default)
    {},
    dict(BLOCK_H=64, BLOCK_K=64, num_warps=4, num_stages=2),
    dict(BLOCK_H=64, BLOCK_K=128, num_warps=8, num_stages=1),
    dict(BLOCK_H=128, BLOCK_K=32, num_warps=4, num_stages=2),
    dict(BLOCK_H=128, BLOCK_K=64, num_warps=8, num_stages=1),
]
PROBS_CFG: dict | None = None  # the target pass's tiles once swept (None: not yet)


def bench_backward_peers(contexts, do_sweep):
    """dsaflow's sparse MLA backward and cuDNN-Frontend's, on the same inputs and each query's key extent (as the
    autograd Function calls them): time, TFLOP/s, time ratio, agreement of dq and dkv, the dispatcher's choice."""
    from dsaflow.ops.sparse_mla import cudnn_backward as cb
    from dsaflow.ops.sparse_mla.dispatch import ENV_BACKWARD, explain_sparse_mla

    missing = cb.cudnn_import_error()
    if missing is not None:
        print(f"peers: skipped, {missing}", flush=True)
        return
    peer = f"cudnn-frontend {cb.cudnn_version()}"
    scale, n_bwd = D_QK**-0.5, 2048
    for ctx, batch in [(c, 1) for c in contexts] + [(contexts[0], 2)]:
        q, kv, idx = mla_inputs(ctx, n_bwd, batch=batch)
        n_keys = key_extent(idx, ctx)
        out, lse = sparse_mla_fwd_triton(q, kv, idx, scale, D_V, n_keys=n_keys)
        do = torch.randn_like(out)
        pass1 = "hopper" if hopper_bwd_supports(q, kv, idx, D_V) is None else "triton"  # dsaflow's rule
        ours = lambda: sparse_mla_bwd_triton(q, kv, idx, out, lse, do, None, scale, D_V, n_keys=n_keys, pass1=pass1)
        theirs = lambda: cb.sparse_mla_bwd_cudnn(q, kv, idx, out, lse, do, scale, D_V, n_keys)
        (dq_o, dkv_o), (dq_p, dkv_p) = ours(), theirs()  # the first cuDNN call compiles its kernels
        err_dq, err_dkv = rel_err(dq_p, dq_o), rel_err(dkv_p, dkv_o)
        del dq_o, dkv_o, dq_p, dkv_p
        ms_o, ms_p = bench(ours, rep_ms=300), bench(theirs, rep_ms=300)
        choice = explain_sparse_mla(q, kv, idx, D_V, backward=True, deterministic=False)
        flops = 2 * H * TOPK * (3 * D_QK + 2 * D_V) * n_bwd * batch
        shape = dict(queries=n_bwd, batch=batch, heads=H)
        a = record("sparse_mla_bwd side by side", f"dsaflow ({pass1} pass 1)", ctx, ms_o, flops=flops, **shape)
        b = record("sparse_mla_bwd side by side", peer, ctx, ms_p, flops=flops, **shape)
        row = dict(
            context=ctx,
            batch=batch,
            dsaflow_ms=a["time_ms"],
            dsaflow_tflops=a["tflops"],
            peer=peer,
            peer_ms=b["time_ms"],
            peer_tflops=b["tflops"],
            dsaflow_over_peer_time=round(ms_o / ms_p, 3),
            rel_err_dq=float(f"{err_dq:.2e}"),
            rel_err_dkv=float(f"{err_dkv:.2e}"),
            dispatcher_picks=choice.kernel,
            dispatcher_why=str(choice),
            env=os.environ.get(ENV_BACKWARD, "auto"),
        )
        row.update(backward_with_target(q, kv, idx, n_keys, out, lse, do, ctx, shape, flops, peer, do_sweep, pass1))
        PEERS.append(row)
        print("peers", json.dumps(row), flush=True)
        assert max(err_dq, err_dkv) < 1e-2, f"dsaflow and {peer} disagree at {ctx} x {batch}: {row}"
        assert row["rel_err_target"] < 1e-3, f"the target pass and dsaflow's backward disagree: {row}"
        del q, kv, idx, n_keys, out, lse, do


def backward_with_target(q, kv, idx, n_keys, out, lse, do, ctx, shape, bwd_flops, peer, do_sweep, pass1):
    """The backward with the indexer-loss target (`probs_into`, weight 0.5 into one fp32 [B, T, K] buffer): dsaflow's
    (pass 1 sums P) and cuDNN-Frontend's + dsaflow's target pass, the pass alone, and `attention_target`'s kernel
    (one program per query, all heads) on the same target. The pass's tiles: swept at the first context unless
    --no-sweep, else its defaults. Returns the fields for the side-by-side row."""
    from dsaflow.ops.indexer_loss.triton_target import attention_target_triton
    from dsaflow.ops.sparse_mla import cudnn_backward as cb
    from dsaflow.ops.sparse_mla.dispatch import explain_sparse_mla

    scale, w = D_QK**-0.5, 0.5
    target = torch.zeros(idx.shape, device=idx.device, dtype=torch.float32)
    probs_flops = 2 * H * TOPK * D_QK * shape["queries"] * shape["batch"]
    global PROBS_CFG
    if do_sweep and PROBS_CFG is None:
        make = lambda cfg: lambda: sparse_mla_probs_triton(q, kv, idx, lse, scale, D_V, (target, w), n_keys, cfg)
        PROBS_CFG = sweep("sparse_mla target pass", make, PROBS_SWEEP) or {}
    cfg = PROBS_CFG or {}
    probs = lambda t: sparse_mla_probs_triton(q, kv, idx, lse, scale, D_V, (t, w), n_keys=n_keys, overrides=cfg)
    ours = lambda t: sparse_mla_bwd_triton(
        q, kv, idx, out, lse, do, None, scale, D_V, n_keys=n_keys, probs_into=(t, w), pass1=pass1
    )
    theirs = lambda t: (cb.sparse_mla_bwd_cudnn(q, kv, idx, out, lse, do, scale, D_V, n_keys), probs(t))
    t_ours, t_pass, t_ref = (torch.zeros_like(target) for _ in range(3))
    ours(t_ours)
    probs(t_pass)
    attention_target_triton(q, kv, idx, lse, scale, t_ref, w)
    err_target, err_kernel = rel_err(t_pass, t_ours), rel_err(t_ref, t_ours)
    del t_ours, t_pass, t_ref
    ms_o, ms_p = bench(lambda: ours(target), rep_ms=300), bench(lambda: theirs(target), rep_ms=300)
    ms_pass = bench(lambda: probs(target), rep_ms=300)
    ms_kernel = bench(lambda: attention_target_triton(q, kv, idx, lse, scale, target, w), rep_ms=300)
    choice = explain_sparse_mla(q, kv, idx, D_V, backward=True, probs_into=True, deterministic=False)
    kind = "sparse_mla_bwd + indexer-loss target side by side"
    a = record(kind, f"dsaflow ({pass1} pass 1 sums P)", ctx, ms_o, flops=bwd_flops, **shape)
    b = record(kind, f"{peer} + dsaflow target pass", ctx, ms_p, flops=bwd_flops + probs_flops, **shape)
    c = record("sparse_mla target pass (triton_probs)", "triton", ctx, ms_pass, flops=probs_flops, config=cfg, **shape)
    d = record("indexer-loss attention_target", "triton_target", ctx, ms_kernel, flops=probs_flops, **shape)
    return dict(
        dsaflow_target_ms=a["time_ms"],
        dsaflow_target_tflops=a["tflops"],
        peer_target_ms=b["time_ms"],
        peer_target_tflops=b["tflops"],
        dsaflow_over_peer_target_time=round(ms_o / ms_p, 3),
        target_pass_ms=c["time_ms"],
        target_pass_tflops=c["tflops"],
        target_pass_config=cfg,
        attention_target_kernel_ms=d["time_ms"],
        rel_err_target=float(f"{err_target:.2e}"),
        rel_err_attention_target_kernel=float(f"{err_kernel:.2e}"),
        dispatcher_picks_with_target=choice.kernel,
        dispatcher_why_with_target=str(choice),
    )


def peers_markdown() -> list[str]:
    """The two side-by-side tables (none when cuDNN-Frontend was not installed)."""
    lines: list[str] = []
    if PEERS:
        lines += [
            "",
            f"Backward side by side ({PEERS[0]['peer']}; h{H}, d_qk {D_QK}, d_v {D_V}, top-k {TOPK}, the last 2048 "
            "queries of each context; FLOPs 2*H*K*(3*d_qk + 2*d_v) per query; rel err: cuDNN vs dsaflow):",
            "",
            "| context | batch | dsaflow ms | TFLOP/s | cuDNN ms | TFLOP/s | dsaflow / cuDNN time | rel err dq | "
            "rel err dkv | dispatcher picks |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['context']} | {r['batch']} | {r['dsaflow_ms']:.3f} | {r['dsaflow_tflops']} | {r['peer_ms']:.3f} | "
            f"{r['peer_tflops']} | {r['dsaflow_over_peer_time']:.2f}x | {r['rel_err_dq']:.1e} | "
            f"{r['rel_err_dkv']:.1e} | {r['dispatcher_picks']} |"
            for r in PEERS
        ]
        lines += [
            "",
            "With the indexer-loss target (`probs_into`): dsaflow's backward sums P in its pass 1; cuDNN-Frontend's "
            "is followed by dsaflow's target pass (`triton_probs.py`, 2*H*K*d_qk FLOPs per query, tiles "
            f"{PEERS[0]['target_pass_config'] or 'default'}). TFLOP/s of executed FLOPs (cuDNN + pass: both); "
            "rel err target: the pass vs dsaflow's backward; `attention_target`: the indexer-loss op's kernel:",
            "",
            "| context | batch | dsaflow ms | TFLOP/s | cuDNN + pass ms | TFLOP/s | dsaflow / (cuDNN + pass) | "
            "pass ms | pass TFLOP/s | attention_target ms | rel err target | dispatcher picks |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['context']} | {r['batch']} | {r['dsaflow_target_ms']:.3f} | {r['dsaflow_target_tflops']} | "
            f"{r['peer_target_ms']:.3f} | {r['peer_target_tflops']} | {r['dsaflow_over_peer_target_time']:.2f}x | "
            f"{r['target_pass_ms']:.3f} | {r['target_pass_tflops']} | {r['attention_target_kernel_ms']:.3f} | "
            f"{r['rel_err_target']:.1e} | {r['dispatcher_picks_with_target']} |"
            for r in PEERS
        ]
    return lines
