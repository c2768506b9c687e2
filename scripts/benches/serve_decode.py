"""Decode benchmark: per-token latency and tokens/s, eager vs CUDA graphs, across batch sizes, models and GPU counts.

    python scripts/bench_serve.py decode                             # models small,mid; batch 1..64; 1 GPU
    python scripts/bench_serve.py decode --gpus 1,2,4                # + 2- and 4-stage pipelines (torchrun, NCCL)
    python scripts/bench_serve.py decode --device cpu --models tiny --batches 1,2 --steps 4 --gpus 1,2   # CPU smoke
    python scripts/bench_serve.py decode --merge out_g1/bench_decode.json out_g4/bench_decode.json --out DIR

For every (model, GPUs, batch): the model is split into `GPUs` pipeline stages (one process per stage, p2p between
them), B prompts of --prompt-len random bytes are prefilled, then --steps decode steps are timed — once with every
stage running eagerly, once with each stage's decode step replayed from a CUDA graph captured for exactly batch B.
Per-token latency = decode wall time / decode steps (one token per row per step, measured on the last stage's rank
between two device syncs, so it includes the pipeline's p2p hops); tokens/s = B / latency; "graphs remove" =
1 - graph latency / eager latency, the share of decode time that was launch overhead the graphs removed.
On CPU only the eager mode runs (graphs need CUDA): it exists so CI proves the script works.

Writes <out>/bench_decode.json (every measurement + environment) and <out>/bench_decode.md (the tables).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from bench_lib import environment, out_dir, resolve_device, rows_from_ranks, write_rank_rows, write_results

from dsaflow.config.compose import compose
from dsaflow.plan import build_plan
from dsaflow.serve.engine import PipelineEngine
from dsaflow.serve.generate import build_stage_modules, serve_dtype

ENTRY = Path(__file__).resolve().parents[1] / "bench_serve.py"  # what torchrun starts on every rank


def parse_args(argv=None, prog: str = "bench_serve.py decode"):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,mid", help="model configs (configs/model/*.yaml), comma separated")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--gpus", default="1", help="pipeline sizes (processes = stages), comma separated")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per repeat")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up (median reported)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"))
    ap.add_argument("--overrides", default="", help="extra config overrides, space separated (e.g. index=every4)")
    ap.add_argument("--out", default="bench_out/decode")
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="only combine earlier bench_decode.json files (e.g. one per machine) into one JSON + table",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set when started by torchrun
    ap.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rows-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.device = resolve_device(prog, args.device)
    return args


def make_cfg(args, model: str, pp: int, batch: int, graphs: bool):
    overrides = [
        "mode=serve",
        "track=none",
        f"model={model}",
        f"pipeline.stages={pp}",
        f"serve.dtype={args.dtype}",
        f"serve.max_batch={batch}",
        f"serve.max_new_tokens={args.steps + 1}",
        f"serve.max_context={args.prompt_len + args.steps + 1}",
        f"serve.prefill_chunk={args.prompt_len}",
        "graphs=decode" if graphs else "graphs=off",
        *args.overrides.split(),
    ]
    cfg = compose(overrides)
    cfg.serve.microbatches = 1  # one batch through the stages: the latency of a decode step of the whole pipeline
    if graphs:
        cfg.graphs.blocks[0].shape_classes = [batch]  # captured for exactly this batch: no padding in the comparison
    return cfg, build_plan(cfg)


def measure(args, model: str, pp: int, rank: int, device: torch.device, link):
    """All (batch, mode) measurements of one model on this rank; rows on the last stage's rank, [] elsewhere."""
    rows = []
    modes = ("eager", "graphs") if device.type == "cuda" else ("eager",)
    cfg0, plan0 = make_cfg(args, model, pp, 1, False)
    dtype = serve_dtype(args.dtype, device)
    stages = build_stage_modules(cfg0, plan0, rank, device, dtype)  # built once, reused by every engine
    params = plan0.estimates["total"]["params"]
    g = torch.Generator().manual_seed(0)
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = torch.randint(0, cfg0.model.vocab_size, (batch, args.prompt_len), generator=g).tolist()
        for mode in modes:
            cfg, plan = make_cfg(args, model, pp, batch, mode == "graphs")
            eng = PipelineEngine(cfg.model, plan, stages, cfg.serve, cfg.graphs, device, dtype, rank, link)
            t0 = time.perf_counter()
            report = eng.capture()
            capture_s = time.perf_counter() - t0
            eng.generate(prompts)  # warm-up (compiles kernels in eager mode)
            per_step, prefill = [], []
            for _ in range(args.repeats):
                eng.timings = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "tokens": 0}
                eng.generate(prompts)
                per_step.append(eng.timings["decode_s"] / max(eng.timings["decode_steps"], 1))
                prefill.append(eng.timings["prefill_s"])
            if eng.owner[plan.num_stages - 1] == rank:
                lat = statistics.median(per_step)
                rows.append(
                    {
                        "model": model,
                        "params": params,
                        "gpus": pp,
                        "batch": batch,
                        "mode": mode,
                        "per_token_ms": lat * 1e3,
                        "tokens_per_s": batch / lat,
                        "decode_steps": args.steps,
                        "prefill_ms": statistics.median(prefill) * 1e3,
                        "repeats_ms": [x * 1e3 for x in per_step],
                        "capture_s": capture_s if mode == "graphs" else 0.0,
                        "graph_pool_mib": sum(r.pool_bytes for r in report.records) / 2**20,
                        "device": str(device),
                    }
                )
            del eng
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def worker(args) -> None:
    """One pipeline rank under torchrun: NCCL on GPUs, gloo on CPU."""
    import torch.distributed as dist

    from dsaflow.pipeline.p2p import torchrun_rank

    with torchrun_rank(args.device) as (device, link):
        rows = []
        for model in args.models.split(","):
            rows += measure(args, model, args.pp, dist.get_rank(), device, link)
        if rows:
            write_rank_rows(args.rows_file, rows)


def run_pipeline(args, pp: int) -> list:
    """pp stages in pp processes via torchrun; returns the last rank's rows."""
    return rows_from_ranks(
        ENTRY,
        [
            "decode",
            "--worker",
            f"--pp={pp}",
            f"--models={args.models}",
            f"--batches={args.batches}",
            f"--steps={args.steps}",
            f"--repeats={args.repeats}",
            f"--prompt-len={args.prompt_len}",
            f"--device={args.device}",
            f"--dtype={args.dtype}",
            f"--overrides={args.overrides}",
        ],
        pp,
    )


def add_savings(rows: list) -> list:
    eager = {(r["model"], r["gpus"], r["batch"]): r for r in rows if r["mode"] == "eager"}
    for r in rows:
        e = eager.get((r["model"], r["gpus"], r["batch"]))
        r["graphs_remove"] = (1 - r["per_token_ms"] / e["per_token_ms"]) if (e and r["mode"] == "graphs") else None
    return rows


def markdown(rows: list, env: dict) -> str:
    lines = [
        "# Decode benchmark: eager vs CUDA graphs",
        "",
        f"{env['device_name']}, torch {env['torch']}, dtype {env['dtype']}, prompt {env['prompt_len']} tokens, "
        f"{env['steps']} decode steps x {env['repeats']} repeats (median). Per-token latency = one decode step "
        f"of the whole pipeline (all stages + p2p hops); tokens/s = batch / latency; graphs remove = 1 - graphs "
        f"latency / eager latency.",
        "",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        mr = [r for r in rows if r["model"] == model]
        lines += [
            f"## {model} ({mr[0]['params'] / 1e6:.2f}M parameters)",
            "",
            "| stages (GPUs) | batch | eager ms/token | graphs ms/token | eager tokens/s | graphs tokens/s "
            "| graphs remove |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for gpus in sorted({r["gpus"] for r in mr}):
            for batch in sorted({r["batch"] for r in mr if r["gpus"] == gpus}):
                e = next((r for r in mr if (r["gpus"], r["batch"], r["mode"]) == (gpus, batch, "eager")), None)
                gr = next((r for r in mr if (r["gpus"], r["batch"], r["mode"]) == (gpus, batch, "graphs")), None)
                cell = lambda r, k, f: f.format(r[k]) if r else "-"  # noqa: E731
                share = f"{gr['graphs_remove'] * 100:.1f}%" if gr and gr["graphs_remove"] is not None else "-"
                lines.append(
                    f"| {gpus} | {batch} | {cell(e, 'per_token_ms', '{:.3f}')} | "
                    f"{cell(gr, 'per_token_ms', '{:.3f}')} | {cell(e, 'tokens_per_s', '{:.0f}')} | "
                    f"{cell(gr, 'tokens_per_s', '{:.0f}')} | {share} |"
                )
        lines.append("")
    return "\n".join(lines)


def write(out: Path, rows: list, env: dict) -> None:
    write_results(out, "bench_decode", {"env": env, "rows": rows}, markdown(rows, env))


def merge(paths, out: Path) -> None:
    parts = [json.loads(Path(p).read_text()) for p in paths]
    rows = add_savings([r for part in parts for r in part["rows"]])
    write(out, rows, dict(parts[0]["env"], merged_from=[str(p) for p in paths]))


def main(argv=None, prog: str = "bench_serve.py decode") -> int:
    args = parse_args(argv, prog)
    if args.worker:
        worker(args)
        return 0
    out = out_dir(prog, args.out)
    if args.merge:
        merge(args.merge, out)
        return 0
    device = torch.device(args.device)
    rows = []
    for pp in [int(p) for p in args.gpus.split(",")]:
        print(f"{prog}: {pp} process(es), models {args.models}, batches {args.batches}", flush=True)
        if pp == 1:
            for model in args.models.split(","):
                rows += measure(args, model, 1, 0, device, None)
        else:
            rows += run_pipeline(args, pp)
        print(f"done: {pp} process(es)", flush=True)
    rows = add_savings(rows)
    env = {
        **environment(device),
        "device": args.device,
        "dtype": str(serve_dtype(args.dtype, device)),
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "repeats": args.repeats,
        "overrides": args.overrides,
    }
    write(out, rows, env)
    return 0
