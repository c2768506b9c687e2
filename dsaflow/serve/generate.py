"""`dsaflow generate`: serve a DSA model across pipeline stages. `run_serve(ctx)` is the worker's "generate" job.

Parent (before any process starts): `check_serve(cfg, plan)` validates the serve config, the prompts and the graph
blocks and raises `ServeError` (a PlanError: one paragraph, exit status 2). Worker, per rank:

    prompts (serve.prompts or serve.prompts_file JSONL {"prompt": ...}) -> byte tokenizer
    build this rank's stages (random init from train.seed, or serve.checkpoint) on ctx.device in serve.dtype
    PipelineEngine: preallocated caches, graph blocks captured on this device -> capture report (printed, logged,
                    written to <run_dir>/graphs_rank<r>.json)
    generate -> the last stage's rank prints the completions, or writes serve.output_file (JSONL)
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from dsaflow.data.tokenizer import ByteTokenizer
from dsaflow.errors import ServeError
from dsaflow.files import UnsafeFile, read_text
from dsaflow.plan.plan import Plan
from dsaflow.run.stages import stage_module

from .engine import PipelineEngine, check_graph_blocks, check_prompts

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def serve_dtype(name: str, device: torch.device) -> torch.dtype:
    """serve.dtype (the schema's auto | fp32 | bf16) -> torch dtype."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return DTYPES[str(name)]


def load_prompts(serve_cfg) -> List[str]:
    """serve.prompts (a list) or serve.prompts_file (JSONL, {"prompt": "..."} per line) -> prompt strings."""
    given, path = list(serve_cfg.prompts or []), serve_cfg.prompts_file
    if given and path:
        raise ServeError(
            f"both serve.prompts ({len(given)} prompts) and serve.prompts_file={path} are set. Fix: give one of them."
        )
    if not given and not path:
        raise ServeError(
            'no prompts. Fix: set serve.prompts=["Hello","Once upon"] or serve.prompts_file=prompts.jsonl '
            '(one {"prompt": "..."} per line).'
        )
    if given:
        return [str(p) for p in given]
    try:  # a regular file only: a FIFO or a folder is named as such, never waited on
        text = read_text(path)
    except UnsafeFile as exc:
        raise ServeError(f"serve.prompts_file={path}: {exc}. Fix: point it at a JSONL file.") from None
    prompts = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row["prompt"], str):
                raise TypeError
            prompts.append(row["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError, RecursionError):
            raise ServeError(
                f'serve.prompts_file={path} line {n} is not a JSON object with a string "prompt": {line[:80]!r}. '
                'Fix: one {"prompt": "..."} per line.'
            ) from None
    if not prompts:
        raise ServeError(f"serve.prompts_file={path} holds no prompts. Fix: add {{\"prompt\": \"...\"}} lines.")
    return prompts


def check_serve(cfg, plan: Plan, device_type: Optional[str] = None) -> Tuple[List[str], List[List[int]]]:
    """Everything about a generate job that can be checked in the parent -> (prompts, their token ids)."""
    s = cfg.serve  # ranges and choices: dsaflow.config.schema (checked at compose); cross-field rules here
    if s.eos_id is not None and not 0 <= s.eos_id < cfg.model.vocab_size:
        raise ServeError(f"serve.eos_id={s.eos_id} is outside model.vocab_size={cfg.model.vocab_size}. Fix: a valid id.")
    if s.checkpoint:
        if not os.path.exists(s.checkpoint):
            raise ServeError(f"serve.checkpoint={s.checkpoint} does not exist. Fix: a run dir or a checkpoint folder.")
        from .weights import check_same_model, resolve_checkpoint

        check_same_model(cfg.model, resolve_checkpoint(s.checkpoint))
    check_graph_blocks(plan, s)
    if plan.graph_blocks and device_type == "cpu" and cfg.graphs.on_failure == "error":
        raise ServeError(
            f"graphs={cfg.graphs.name} requests CUDA graph blocks {[b.name for b in plan.graph_blocks]} but the "
            f"workers run on cpu. Fix: graphs=off on CPU, or graphs.on_failure=eager to run the blocks eagerly."
        )
    tok = ByteTokenizer()
    prompts = load_prompts(s)
    ids = [tok.encode(p) for p in prompts]
    check_prompts(ids, s, cfg.model.vocab_size)
    return prompts, ids


def build_stage_modules(cfg, plan: Plan, rank: Optional[int], device, dtype) -> dict:
    """{stage index: StageModule} for the stages of `rank` (every stage when rank is None), weights from
    serve.checkpoint or seeded random init (train.seed, the same init as training)."""
    owned = plan.stages if rank is None else plan.stages_of_rank(rank)
    stages = {sp.index: stage_module(cfg.model, plan, sp.index, seed=cfg.train.seed) for sp in owned}
    if cfg.serve.checkpoint:
        from .weights import load_model_weights

        load_model_weights(stages, cfg.serve.checkpoint, cfg.model)
    return {s: m.to(device=device, dtype=dtype).eval() for s, m in stages.items()}


def build_engine(
    cfg, plan: Plan, rank: int, device, link=None, force_eager: bool = False, capturer=None, all_stages: bool = False
):
    """This rank's PipelineEngine (stages built, caches allocated; call `.capture()` before generating).
    all_stages=True: this one process runs every stage of the plan (no p2p)."""
    device = torch.device(device)
    dtype = serve_dtype(cfg.serve.dtype, device)
    stages = build_stage_modules(cfg, plan, None if all_stages else rank, device, dtype)
    return PipelineEngine(
        cfg.model, plan, stages, cfg.serve, cfg.graphs, device, dtype, rank, link, force_eager, capturer
    )


def write_outputs(prompts: List[str], outputs: List[List[int]], output_file: Optional[str]) -> None:
    tok = ByteTokenizer()
    rows = [{"prompt": p, "completion": tok.decode(o), "tokens": o} for p, o in zip(prompts, outputs)]
    if output_file:
        Path(output_file).parent.mkdir(parents=True, exist_ok=True)
        with open(output_file, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"wrote {len(rows)} completions to {output_file}", flush=True)
        return
    for i, r in enumerate(rows):
        print(f"--- [{i}] {r['prompt']!r}\n{r['completion']}", flush=True)


def _log(run_dir, rank: int, text: str) -> None:
    with open(Path(run_dir) / f"serve_rank{rank}.log", "a") as f:
        f.write(text.rstrip() + "\n")


def run_serve(ctx) -> None:
    """The worker's generate job (see the module docstring). A ServeError ends the worker with exit status 2 and
    one paragraph (dsaflow.worker)."""
    cfg, plan = ctx.cfg, ctx.plan
    prompts, ids = check_serve(cfg, plan, ctx.device.type)
    link = None
    if ctx.world_size > 1:
        from dsaflow.run.p2p import StageLink

        link = StageLink(ctx.device)
        link.warm_up()
    engine = build_engine(cfg, plan, ctx.rank, ctx.device, link)
    report = engine.capture()
    text = report.render()
    if report.records:  # nothing requested on this rank (CPU, graphs=off): no empty table on the terminal
        print(text, flush=True)
    _log(ctx.run_dir, ctx.rank, text)
    report.write_json(str(ctx.run_dir))
    t0 = time.perf_counter()
    outputs = engine.generate(ids)
    wall = time.perf_counter() - t0
    t = engine.timings
    summary = (
        f"[rank {ctx.rank}] generated {t['tokens']} tokens for {len(ids)} prompts in {wall:.2f} s "
        f"(prefill {t['prefill_s']:.3f} s, decode {t['decode_s']:.3f} s over {t['decode_steps']} steps)"
    )
    _log(ctx.run_dir, ctx.rank, summary)
    if outputs is not None:
        write_outputs(prompts, outputs, cfg.serve.output_file)
        print(summary, flush=True)

