"""`dsaflow generate`: serve a DSA model across pipeline stages. `run_serve(ctx)` is the worker's "generate" job.

Parent (before any process starts): `check_serve(cfg, plan)` validates the serve config, the prompts and the graph
blocks and raises `ServeError` (a PlanError: one paragraph, exit status 2). Worker, per rank:

    requests (serve.prompts, or serve.prompts_file JSONL {"prompt": ..., "max_new_tokens": n (optional)}; a prompt
        may be a list of token ids) -> the byte tokenizer, or the checkpoint's tokenizer.json with model=hf;
        a request with len + max_new_tokens > serve.max_context is rejected (named) and the rest served
    build this rank's stages (random init from train.seed, serve.checkpoint, or model.hf_path's weights: only this
        rank's tensors, memory-mapped, the bytes read reported) on ctx.device in serve.dtype; serve.weights=fp8:
        the projections in e4m3 with 128x128 block scales (dsaflow.model.fp8_weights)
    PipelineEngine: preallocated caches split into microbatch groups, graph blocks captured on this device ->
                    capture report (printed, logged, written to <run_dir>/graphs_rank<r>.json)
    generate (continuous batching, a progress bar on the last stage's rank) -> the last stage's rank prints the
        completions, or writes serve.output_file (JSONL in input order: tokens, num_tokens, ttft_s, tpot_s, or
        error for a rejected request)

With parallel.dp = N > 1 the ranks form N replicas of the pipeline (dsaflow/serve/replicas.py): each serves every
N-th request, and replica 0's last stage gathers the others' outputs and is the one that prints or writes them.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from dsaflow.checkpoint.hf_folder import tokenizer_json
from dsaflow.checkpoint.hf_run_copy import hf_files_folder
from dsaflow.config.fp8_policy import FP8
from dsaflow.data.hf_tokenizer import checkpoint_tokenizer
from dsaflow.errors import ServeError, shown
from dsaflow.files import atomic_write
from dsaflow.model.fp8_weights import materialize_, quantize_stage_
from dsaflow.pipeline.stages import check_hf_checkpoint, stage_module
from dsaflow.plan.plan import Plan
from dsaflow.rundir.folder import CONFIG

from .checks import check_graph_blocks, check_mixed_passes, check_prompts, check_transfers, fit_problem
from .engine import PipelineEngine
from .prompts import load_requests
from .replicas import ReplicaResult, gather_results, merged, replica_lines, replica_share
from .speculative_engine import check_speculation, speculation_line

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def serve_dtype(name: str, device: torch.device) -> torch.dtype:
    """serve.dtype (the schema's auto | fp32 | bf16) -> torch dtype."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return DTYPES[str(name)]


@dataclass
class Requests:
    """The prompts of a generate job, in input order: text, token ids, per-request max_new_tokens, where each came
    from (for messages) and why a request is rejected (None when it is served)."""

    prompts: List[str]
    ids: List[List[int]]
    max_new: List[int]
    where: List[str]
    rejected: List[Optional[str]]
    answers: List[Optional[str]] = field(default_factory=list)  # the prompts file's "answer" field, when it has one

    @property
    def served(self) -> List[int]:
        return [i for i, r in enumerate(self.rejected) if r is None]


def load_prompts(serve_cfg) -> List[str]:
    """serve.prompts (a list) or serve.prompts_file (JSONL) -> prompt strings."""
    return [p for p, _, _ in load_requests(serve_cfg)]


def check_serve(cfg, plan: Plan, device_type: Optional[str] = None, hf_headers: bool = True) -> Requests:
    """Everything about a generate job that can be checked in the parent -> its requests. A request that does not
    fit serve.max_context is rejected (named, the others are served); the job fails only when none fits.
    hf_headers: with model.hf_path, check the headers of every tensor the plan needs (the parent; a worker's load
    checks its own stages' again)."""
    check_serve_model(cfg, plan, device_type, hf_headers)
    s = cfg.serve
    tok = job_tokenizer(cfg.model, s)
    answers: List[Optional[str]] = []
    loaded = load_requests(s, answers)
    ids = [list(p) if isinstance(p, list) else tok.encode(p) for p, _, _ in loaded]
    check_prompts(ids, cfg.model.vocab_size)
    rejected = [fit_problem(i, q, m, s.max_context, where) for i, (q, (_, m, where)) in enumerate(zip(ids, loaded))]
    reqs = Requests([p for p, _, _ in loaded], ids, [m for _, m, _ in loaded], [w for _, _, w in loaded], rejected)
    reqs.answers = answers if any(a is not None for a in answers) else []
    if not reqs.served:
        raise ServeError(f"no request fits: {rejected[0]}")
    return reqs


def check_serve_model(cfg, plan: Plan, device_type: Optional[str] = None, hf_headers: bool = True) -> None:
    """What `dsaflow generate` and `dsaflow serve` check before serving any request: the serve config against the
    model and plan, the checkpoint, the graph blocks. Raises ServeError."""
    s = cfg.serve  # ranges and choices: dsaflow.config.schema (checked at compose); cross-field rules here
    if s.eos_id is not None and not 0 <= s.eos_id < cfg.model.vocab_size:
        raise ServeError(
            f"serve.eos_id={s.eos_id} is outside model.vocab_size={cfg.model.vocab_size}. Fix: a valid id."
        )
    if s.checkpoint:
        if not os.path.exists(s.checkpoint):
            raise ServeError(f"serve.checkpoint={s.checkpoint} does not exist. Fix: a run dir or a checkpoint folder.")
        from dsaflow.checkpoint.weights import check_same_model, resolve_checkpoint

        check_same_model(cfg.model, resolve_checkpoint(s.checkpoint))
    check_graph_blocks(plan, s)
    check_mixed_passes(s, plan)
    check_speculation(cfg.model, s, plan)
    if plan.graph_blocks and device_type == "cpu" and cfg.graphs.on_failure == "error":
        raise ServeError(
            f"graphs={cfg.graphs.name} requests CUDA graph blocks {[b.name for b in plan.graph_blocks]} but the "
            f"workers run on cpu. Fix: graphs=off on CPU, or graphs.on_failure=eager to run the blocks eagerly."
        )
    check_transfers(cfg.graphs, plan, device_type)
    if hf_headers and not s.checkpoint and cfg.model.hf_path:  # the workers' loads check their own tensors again
        check_hf_checkpoint(cfg, plan, ServeError)


def build_stage_modules(cfg, plan: Plan, rank: Optional[int], device, dtype) -> dict:
    """{stage index: StageModule} for the stages of `rank` (every stage when rank is None), weights from
    serve.checkpoint, model.hf_path or seeded random init (train.seed, the same init as training), on `device` in
    `dtype`. serve.weights=fp8: the policy's projections in e4m3 + block scales (dsaflow.model.fp8_weights); an
    FP8 Hugging Face checkpoint's are kept as stored (the stages are built on the meta device and filled from the
    file, no bf16 copy anywhere), other weights are quantized one layer at a time as they move to the device."""
    owned = plan.stages if rank is None else plan.stages_of_rank(rank)
    fp8 = str(cfg.serve.weights) == FP8
    if fp8 and cfg.model.hf_path and not cfg.serve.checkpoint:
        with torch.device("meta"):
            stages = {sp.index: stage_module(cfg.model, plan, sp.index, seed=0) for sp in owned}
        stages = {s: materialize_(quantize_stage_(m, "meta", dtype), device) for s, m in stages.items()}
        load_hf_stages(stages, cfg.model, rank)  # every tensor of the stages comes from the file
        return {s: m.eval() for s, m in stages.items()}
    stages = {sp.index: stage_module(cfg.model, plan, sp.index, seed=cfg.train.seed) for sp in owned}
    if cfg.serve.checkpoint:
        from dsaflow.checkpoint.weights import load_model_weights

        load_model_weights(stages, cfg.serve.checkpoint, cfg.model)
    elif cfg.model.hf_path:
        load_hf_stages(stages, cfg.model, rank)
    if fp8:
        return {s: quantize_stage_(m, device, dtype).eval() for s, m in stages.items()}
    return {s: m.to(device=device, dtype=dtype).eval() for s, m in stages.items()}


def build_engine(
    cfg,
    plan: Plan,
    rank: int,
    device,
    link=None,
    force_eager: bool = False,
    capturer=None,
    all_stages: bool = False,
    peer=None,
    per_request_sampling: bool = False,
):
    """This rank's PipelineEngine (stages built, caches allocated; call `.capture()` before generating).
    all_stages=True: this one process runs every stage of the plan (no p2p). peer: pipeline rank -> global rank
    (serving replicas; identity by default). per_request_sampling: each request's own temperature, top_p and seed
    (`dsaflow serve`)."""
    device = torch.device(device)
    dtype = serve_dtype(cfg.serve.dtype, device)
    stages = build_stage_modules(cfg, plan, None if all_stages else rank, device, dtype)
    return PipelineEngine(
        cfg.model,
        plan,
        stages,
        cfg.serve,
        cfg.graphs,
        device,
        dtype,
        rank,
        link,
        force_eager,
        capturer,
        peer,
        per_request_sampling,
    )


def trained_run_dir(checkpoint: Optional[str]) -> Optional[Path]:
    """The run dir of serve.checkpoint (a run dir, or one of its checkpoints/step-N folders); None without one."""
    if not checkpoint:
        return None
    p = Path(checkpoint)
    return p if os.path.lexists(p / CONFIG) else p.parent.parent


def job_tokenizer(model_cfg, serve_cfg):
    """The tokenizer of a generate job: model.hf_path's tokenizer.json, or the trained run's copy of it once that
    folder is gone (dsaflow.checkpoint.hf_run_copy); the byte tokenizer without model.hf_path."""
    folder = hf_files_folder(model_cfg.hf_path, trained_run_dir(serve_cfg.checkpoint))
    return checkpoint_tokenizer(tokenizer_json(folder))


def output_rows(reqs: Requests, outputs: Dict[int, List[int]], stats: Optional[dict] = None, tok=None) -> List[dict]:
    """One JSON row per request, in input order: prompt, completion, tokens, num_tokens, ttft_s, tpot_s; a
    rejected request gets its message under "error" instead. tok: the job's tokenizer (`job_tokenizer`; bytes
    when None)."""
    tok, stats = tok or checkpoint_tokenizer(None), stats or {}
    rows = []
    for i, p in enumerate(reqs.prompts):
        if reqs.rejected[i] is not None:
            rows.append({"prompt": p, "error": reqs.rejected[i]})
            continue
        o = outputs[i]
        rows.append(
            {
                "prompt": p,
                "completion": tok.decode(o),
                "tokens": o,
                "num_tokens": len(o),
                "ttft_s": stats.get("ttft_s", {}).get(i),
                "tpot_s": stats.get("tpot_s", {}).get(i),
            }
        )
        if i < len(reqs.answers) and reqs.answers[i] is not None:  # marked: does the completion start with it
            rows[-1].update(answer=reqs.answers[i], correct=rows[-1]["completion"].startswith(reqs.answers[i]))
    return rows


def accuracy_line(rows: List[dict]) -> Optional[str]:
    """'answers: 7 of 8 right (0.875)' over the rows that carry an answer; None when none does."""
    marked = [r for r in rows if "correct" in r]
    if not marked:
        return None
    right = sum(r["correct"] for r in marked)
    why = 'a completion is right when it starts with the prompt\'s "answer"'
    return f"answers: {right} of {len(marked)} right ({right / len(marked):.3f}; {why})"


def serve_requests(engine: PipelineEngine, reqs: Requests) -> Optional[List[dict]]:
    """Generate every served request -> `output_rows` on the last stage's rank (None on the others)."""
    got = serve_share(engine, reqs, reqs.served)
    if got is None:
        return None
    tok = job_tokenizer(engine.model_cfg, engine.serve)
    return output_rows(reqs, got.tokens, {"ttft_s": got.ttft_s, "tpot_s": got.tpot_s}, tok)


def write_outputs(
    prompts: List[str], outputs: List[List[int]], output_file: Optional[str], rows: Optional[List[dict]] = None
) -> None:
    """Completions as JSONL in serve.output_file, or printed. rows: prebuilt rows (`output_rows`)."""
    tok = checkpoint_tokenizer(None)
    if rows is None:
        rows = [{"prompt": p, "completion": tok.decode(o), "tokens": o} for p, o in zip(prompts, outputs)]
    if output_file:  # checked in the parent (dsaflow.outputs); replaced whole, never half written
        Path(output_file).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(output_file, "".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} completions to {output_file}", flush=True)
        return
    for i, r in enumerate(rows):
        mark = f"   (answer {r['answer']}: {'right' if r['correct'] else 'wrong'})" if "correct" in r else ""
        print(
            f"--- [{i}] {shown(r['prompt'], 200)}\n{r.get('completion', 'REJECTED: ' + str(r.get('error')))}{mark}",
            flush=True,
        )


def load_hf_stages(stages: dict, model_cfg, rank: Optional[int]) -> None:
    """Load `stages` from model.hf_path and say how many bytes this rank read."""
    from dsaflow.checkpoint.hf_weights import load_hf_weights
    from dsaflow.errors import CheckpointError

    try:
        nbytes = load_hf_weights(stages, model_cfg.hf_path, model_cfg)
    except CheckpointError as exc:
        raise ServeError(f"model.hf_path={model_cfg.hf_path}: {exc}") from None
    who = "every rank" if rank is None else f"rank {rank}"
    print(f"[{who}] read {nbytes / 2**20:.2f} MiB of weights from {model_cfg.hf_path} (stages {sorted(stages)})")


def _log(run_dir, rank: int, text: str) -> None:
    with open(Path(run_dir) / f"serve_rank{rank}.log", "a") as f:
        f.write(text.rstrip() + "\n")


def run_serve(ctx) -> None:
    """The worker's generate job (see the module docstring). A ServeError ends the worker with exit status 2 and
    one paragraph (dsaflow.worker). With parallel.dp > 1 this rank belongs to one of the serving replicas
    (dsaflow.serve.replicas): it serves the replica's share, and replica 0's last stage writes every output."""
    cfg, plan = ctx.cfg, ctx.plan
    reqs = check_serve(cfg, plan, ctx.device.type, hf_headers=False)
    me = ctx.global_rank(ctx.rank)  # logs and reports are per process: named by the global rank
    link = None
    if ctx.world_size > 1:
        from dsaflow.pipeline.p2p import StageLink

        link = StageLink(ctx.device)
        link.warm_up()
    engine = build_engine(cfg, plan, ctx.rank, ctx.device, link, peer=ctx.global_rank)
    report = engine.capture()
    text = report.render()
    if report.records:  # nothing requested on this rank (CPU, graphs=off): no empty table on the terminal
        print(text, flush=True)
    _log(ctx.run_dir, me, text)
    report.write_json(str(ctx.run_dir))
    share = replica_share(reqs.served, ctx.dp, ctx.dp_rank)
    is_last = engine.owner[engine.last] == ctx.rank
    writer = is_last and ctx.dp_rank == 0  # the one rank that prints and writes the outputs
    if writer:
        for why in reqs.rejected:
            if why is not None:
                print(f"rejected: {why}", flush=True)
    from dsaflow.track.progress import Progress

    label = "generate" if ctx.dp == 1 else f"generate, replica 0 of {ctx.dp}"
    bar = Progress(len(share), enabled=writer, label=label, unit="requests done")
    every = max(1, len(share) // 20)  # plain-line mode (not a terminal): about 20 lines per job
    shown = [0]

    def progress(done: int, tokens: int) -> None:
        rate = tokens / max(time.perf_counter() - t0, 1e-9)
        line = done // every > shown[0] // every or done == len(share)
        shown[0] = done if line else shown[0]
        bar.update(done, {"tokens_per_s": rate}, print_line=line)

    engine.on_finished = progress
    if ctx.dp > 1:
        import torch.distributed as dist

        dist.barrier()  # the replicas start together: the job's wall time is the slowest replica's
    t0 = time.perf_counter()
    mine = serve_share(engine, reqs, share, ctx.dp_rank)
    bar.close()
    wall = time.perf_counter() - t0
    st = engine.stats if share else {}
    summary = (
        f"[rank {me}{f', replica {ctx.dp_rank}' if ctx.dp > 1 else ''}] generated {st.get('tokens', 0)} tokens for "
        f"{len(share)} requests in {wall:.2f} s ({st.get('tokens', 0) / max(wall, 1e-9):.1f} tokens/s, "
        f"{engine.groups} microbatch groups, {'continuous' if engine.continuous else 'fixed'} batching, busy "
        f"{st.get('busy_fraction', 0.0):.2f} of the time, {st.get('decode_busy', 0.0):.2f} in decode)"
    )
    tg = engine.transfers
    if tg is not None:  # graphs.transfers: how this rank's decode ticks posted their transfers
        summary += f"; transfer graphs: {tg.captures} captured, {tg.replays} replays, {tg.eager_ticks} ticks eager"
    if st.get("speculation"):  # serve.speculative_tokens: how many drafts the verify passes kept
        summary += "; " + speculation_line(st["speculation"])
    _log(ctx.run_dir, me, summary)
    if mine is not None:
        mine.wall_s = wall
        results = gather_results(ctx, mine)
        if results is not None:
            _write_results(ctx, reqs, results, summary)
    hint = host_bound_hint(st, engine.groups, me)
    if hint:  # on the rank it concerns: every rank's host builds every pass, and any of them can be the late one
        print(hint, flush=True)
        _log(ctx.run_dir, me, hint)


def serve_share(engine: PipelineEngine, reqs: Requests, share: List[int], replica: int = 0) -> Optional[ReplicaResult]:
    """Generate the requests `share` (indices into reqs, in input order) -> a ReplicaResult on the last stage's rank
    (None on the others). An empty share runs nothing (no pass, no transfer)."""
    outputs = engine.generate([reqs.ids[i] for i in share], [reqs.max_new[i] for i in share], key_ids=share)
    if outputs is None:
        return None
    result = ReplicaResult(replica, dict(zip(share, outputs)))
    if share:
        result.ttft_s = {share[j]: v for j, v in engine.stats["ttft_s"].items()}
        result.tpot_s = {share[j]: v for j, v in engine.stats["tpot_s"].items()}
        result.output_tokens = int(engine.stats["tokens"])
    return result


def _write_results(ctx, reqs: Requests, results: List[ReplicaResult], summary: str) -> None:
    """Replica 0's last stage: every replica's outputs -> rows in input order, written once; the summaries."""
    job = merged(results)
    tok = job_tokenizer(ctx.cfg.model, ctx.cfg.serve)
    rows = output_rows(reqs, job.tokens, {"ttft_s": job.ttft_s, "tpot_s": job.tpot_s}, tok)
    write_outputs(reqs.prompts, [], ctx.cfg.serve.output_file, rows)
    lines = [summary] + (replica_lines(results, ctx.plan.pipeline.ranks) if ctx.dp > 1 else [])
    marked = accuracy_line(rows)
    for line in lines + ([marked] if marked else []):
        print(line, flush=True)
        _log(ctx.run_dir, ctx.global_rank(ctx.rank), line)


HOST_LATE_HINT = 0.5  # share of decode passes whose GPU waited on the host above which a run says so


def host_bound_hint(stats: dict, groups: int, rank: int) -> Optional[str]:
    """A note when this rank's GPU waited on its host for most decode passes with several groups in flight (the
    engine's `decode_host_late`, GPU only), else None: its stage passes take less GPU time than the host takes per
    tick, so more groups cannot fill its GPU."""
    late = stats.get("decode_host_late")
    if late is None or late <= HOST_LATE_HINT or groups < 2:
        return None
    host_ms = sum(stats.get("decode_host_ms_per_tick", {}).values())
    return (
        f"[rank {rank}] note: this rank's GPU waited on its host for {late:.0%} of decode passes: building and "
        f"launching a tick takes the host {host_ms:.2f} ms, longer than this rank's stage takes on the GPU, so "
        f"{groups} groups cannot keep it busy. Stages of more layers (fewer pipeline ranks) or "
        f"serve.microbatches=1 may serve faster; docs/serving.md, 'Host work per tick'."
    )
