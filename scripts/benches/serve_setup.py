"""What one row of `bench_serve.py engine` serves: the options, the pipeline splits (`ppNxR` = R replicas of ppN),
the workloads, and the composed config of each row (groups, batching, mixed-pass budget, graphs). The measuring and
the torchrun orchestration are `serve_engine.py`'s."""

from __future__ import annotations

import argparse
import math
import random

import torch
from bench_lib import resolve_device

from dsaflow.config.compose import compose
from dsaflow.plan import build_plan

RANKS = {"single": 1, "pp2": 2, "pp4": 4}


def split_of(name: str):
    """A --pipelines entry -> (pipeline, replicas): "pp2" -> ("pp2", 1), "pp2x2" -> ("pp2", 2); None if unknown."""
    base, _, count = name.partition("x")
    if base not in RANKS or (count and (not count.isdigit() or int(count) < 1)):
        return None
    return base, int(count or 1)


def processes(name: str) -> int:
    base, replicas = split_of(name)
    return RANKS[base] * replicas


# the CPU default model: tiny (8 layers) at dim 256. At dim 64 a decode pass is ~10 ms of per-op overhead whatever
# its rows (2-core CPU, one thread), so splitting rows into groups could not show; here the rows cost time.
CPU_WIDE = "model.dim=256 model.inter_dim=1024 model.q_lora_rank=128 model.kv_lora_rank=64"


def add_options(ap: argparse.ArgumentParser, out: str = "bench_out/serve") -> None:
    """The options of a serving run, shared with `bench_serve.py rank`."""
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--workloads", default="mixed,uniform")
    ap.add_argument("--model", default=None, help="configs/model name (default: tiny on CPU, small on CUDA)")
    ap.add_argument("--requests", type=int, default=None, help="requests per workload (default 4096 CPU, 1024 CUDA)")
    ap.add_argument(
        "--max-batch", type=int, default=None, help="serve.max_batch, cache rows (default 1024 CPU, 64 CUDA)"
    )
    ap.add_argument("--prefill-chunk", type=int, default=None, help="serve.prefill_chunk (default 16 CPU, 1024 CUDA)")
    ap.add_argument("--mixed-prompt", default=None, help="lo,hi prompt tokens (default 16,64 CPU; 16,4096 CUDA)")
    ap.add_argument("--mixed-new", default=None, help="lo,hi max_new_tokens (default 16,96 CPU; 16,256 CUDA)")
    ap.add_argument("--uniform-prompt", type=int, default=None, help="default 32 CPU, 512 CUDA")
    ap.add_argument("--uniform-new", type=int, default=None, help="default 32 CPU, 128 CUDA")
    ap.add_argument(
        "--overrides",
        default=None,
        help="extra config overrides, space separated (default on CPU: a tiny model widened to dim 256, "
        "so that a pass's time grows with its rows; 'none' for none)",
    )
    ap.add_argument("--graphs", default=None, choices=("on", "off"), help="CUDA graphs (default on with CUDA)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process on CPU")
    ap.add_argument(
        "--max-pass-tokens",
        default="",
        help="comma separated serve.max_pass_tokens budgets: a row with mixed passes per budget and workload",
    )
    ap.add_argument(
        "--mixed-graphs",
        default="off",
        help="comma separated on / off: each --max-pass-tokens row once per setting, mixed passes replayed from "
        "graphs of padded token-count classes (on, graphs=decode_mixed; needs CUDA graphs) or eager (off)",
    )
    ap.add_argument(
        "--profile-passes",
        action="store_true",
        help="CUDA: time every stage call with CUDA events and record GPU ms per pass kind (decode / prefill / mixed)",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="after each timed run, serve the workload's first 64 requests again under torch.profiler and write "
        "one Chrome trace per rank (<out>/trace-<pipeline>-g<groups>-<workload>-<batching>-rank<r>.json.gz)",
    )
    ap.add_argument(
        "--arrival-rate",
        type=float,
        default=0.0,
        help="online serving: requests arrive as a Poisson process of this many per second (seeded), each row's "
        "time to first token counted from its arrival; the single pipeline only (one process runs every stage). 0 "
        "(default): every request is there at the start, so TTFT includes the wait for a cache row",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=out, help=f"results folder (default {out}, printed when the run starts)")


def finish_args(ap: argparse.ArgumentParser, a: argparse.Namespace, prog: str, one_process: bool = False):
    """The device's defaults filled in; `one_process`: a ppN rank run alone in this process (`bench_serve.py
    rank`), where --profile-passes applies too."""
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if a.profile_passes and (not cuda or (a.pipelines != "single" and not one_process)):
        ap.error("--profile-passes needs --device cuda and --pipelines single (it times one process's passes)")
    a.device = resolve_device(prog, a.device)
    cpu = a.device == "cpu"
    a.model = a.model or ("tiny" if cpu else "small")
    a.requests = a.requests or (4096 if cpu else 1024)
    # on CPU a pass has about 20 ms of per-op cost whatever its rows: with 1024 rows the rows dominate, so splitting
    # them into groups costs little; an eager prefill pass pads every row to its longest chunk, so short chunks
    # waste less on mixed prompt lengths (docs/serving.md, "Tests and benchmark")
    a.max_batch = a.max_batch or (1024 if cpu else 64)
    a.prefill_chunk = a.prefill_chunk or (16 if cpu else 1024)
    a.mixed_prompt = a.mixed_prompt or ("16,64" if cpu else "16,4096")
    a.mixed_new = a.mixed_new or ("16,96" if cpu else "16,256")
    a.uniform_prompt = a.uniform_prompt or (32 if cpu else 512)
    a.uniform_new = a.uniform_new or (32 if cpu else 128)
    a.graphs = a.graphs or ("off" if cpu else "on")
    if a.overrides is None:
        a.overrides = CPU_WIDE if cpu else ""
    a.overrides = "" if a.overrides == "none" else a.overrides
    if a.graphs == "on" and cpu:
        ap.error("--graphs on needs --device cuda")
    settings = a.mixed_graphs.split(",")
    if any(m not in ("on", "off") for m in settings) or len(set(settings)) < len(settings):
        ap.error(f"--mixed-graphs {a.mixed_graphs}: list on and/or off once each. Fix: --mixed-graphs on,off")
    if "on" in settings and (a.graphs != "on" or not a.max_pass_tokens):
        ap.error(
            f"--mixed-graphs {a.mixed_graphs} replays the mixed passes of --max-pass-tokens rows from CUDA graphs, "
            f"but --graphs {a.graphs} and --max-pass-tokens {a.max_pass_tokens or '(none)'}. Fix: --device cuda "
            "--graphs on --max-pass-tokens B1,B2, or --mixed-graphs off"
        )
    if a.arrival_rate < 0:
        ap.error(f"--arrival-rate {a.arrival_rate}: requests per second must be >= 0 (0: all at the start)")
    if a.arrival_rate and (getattr(a, "pipelines", "single") != "single" or one_process):
        ap.error(
            f"--arrival-rate {a.arrival_rate} needs every stage in one process (ranks schedule on their own, and "
            "wall-clock arrivals would make them disagree). Fix: --pipelines single, or --arrival-rate 0"
        )
    return a


def arrival_times(args, n: int) -> list:
    """Seconds after the start at which the n requests arrive: a Poisson process of --arrival-rate per second."""
    rng = random.Random(f"{args.seed}-arrivals")
    times, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(args.arrival_rate)
        times.append(t)
    return times


def workload(args, name: str, vocab: int):
    """(prompts, max_new) of one workload, the same on every rank (seeded)."""
    rng = random.Random(f"{args.seed}-{name}")
    prompts, limits = [], []
    for _ in range(args.requests):
        if name == "mixed":
            lo, hi = (int(x) for x in args.mixed_prompt.split(","))
            L = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
            nlo, nhi = (int(x) for x in args.mixed_new.split(","))
            m = rng.randint(nlo, nhi)
        else:
            L, m = args.uniform_prompt, args.uniform_new
        prompts.append([rng.randrange(vocab) for _ in range(L)])
        limits.append(m)
    return prompts, limits


def mixed_classes(budget: int) -> list:
    """Token-count classes of the mixed graphs for a budget: powers of two from 64 below it, and the budget (a pass
    pads at most to twice its tokens, or to 64)."""
    return [c for c in (64, 128, 256, 512, 1024, 2048, 4096, 8192) if c < budget] + [budget]


def make_cfg(args, name: str, microbatches, context: int, continuous: bool = True, budget=None, mixed_graphs=False):
    pipeline, replicas = split_of(name)
    graphs = ["graphs=decode_prefill"] if args.graphs == "on" else ["graphs=off"]
    graphs = ["graphs=decode_mixed"] if mixed_graphs else graphs
    cfg = compose(
        [
            "mode=serve",
            "track=none",
            f"model={args.model}",
            f"pipeline={pipeline}",
            f"parallel.dp={replicas}",
            *graphs,
            f"serve.max_batch={args.max_batch}",
            f"serve.prefill_chunk={args.prefill_chunk}",
            f"serve.max_context={context}",
            *args.overrides.split(),
        ]
    )
    cfg.serve.microbatches = microbatches
    cfg.serve.batching = "continuous" if continuous else "fixed"  # the engine picks its schedule from it at build
    if budget is not None:  # mixed passes: sparse, so no short-prefill paths, and no prefill graphs
        cfg.serve.max_pass_tokens, cfg.serve.short_prefill = budget, False
        cfg.graphs.blocks = [b for b in cfg.graphs.blocks if b.kind in ("decode", "mixed")]
    if args.graphs == "on":
        groups = microbatches or RANKS[pipeline]
        rows = args.max_batch // groups
        c = args.prefill_chunk
        for b in cfg.graphs.blocks:
            if b.kind == "decode":
                b.shape_classes = [c for c in (1, 2, 4, 8, 16, 32, 64) if c < rows] + [rows]
            elif b.kind == "prefill":
                b.shape_classes = sorted({max(c // 8, 1), max(c // 2, 1), c})
            else:  # mixed (--mixed-graphs on)
                b.shape_classes = mixed_classes(budget)
        cfg.graphs.max_shape = max(cfg.graphs.max_shape, c, rows, budget or 0)
    return cfg, build_plan(cfg)


def budgets(args) -> list:
    return [int(b) for b in args.max_pass_tokens.split(",") if b]


def runs_of(args, pipeline: str) -> list:
    """(workload, serve.microbatches or None for the default, continuous, serve.max_pass_tokens or None, mixed graphs
    "on" / "off" or None without a budget) of every row one pipeline split serves."""
    loads = args.workloads.split(",")
    settings = (None,) if RANKS[split_of(pipeline)[0]] == 1 else (1, None)  # one rank: the default is one group
    rows = [(w, mb, True, None, None) for w in loads for mb in settings]
    rows += [("mixed", None, False, None, None)] * ("mixed" in loads)
    graphs = args.mixed_graphs.split(",")
    return rows + [(w, None, True, b, g) for w in loads for b in budgets(args) for g in graphs]
