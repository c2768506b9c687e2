"""What a generate job's serve config and requests must satisfy, checked before launch (dsaflow.serve.generate) and
again by the engine: microbatch groups, graph blocks against the cache rows, transfer graphs,
prompts and their fit.
"""

from __future__ import annotations

from typing import List, Optional

from dsaflow.config.field_checks import upper_bound
from dsaflow.config.schema import ServeConfig
from dsaflow.errors import ServeError
from dsaflow.plan.plan import Plan

from .passes import Request
from .scheduler import group_ranges

SERVED_KINDS = ("decode", "prefill", "mixed")


def serve_groups(serve_cfg, plan: Plan) -> int:
    """serve.microbatches, or by default the number of pipeline ranks (at most serve.max_batch)."""
    g = getattr(serve_cfg, "microbatches", None)
    return int(g) if g is not None else min(plan.pipeline.ranks, serve_cfg.max_batch)


def check_groups(serve_cfg, plan: Plan) -> int:
    g = serve_groups(serve_cfg, plan)
    if not 1 <= g <= serve_cfg.max_batch:
        raise ServeError(
            f"serve.microbatches={g} must be between 1 and serve.max_batch={serve_cfg.max_batch} (each group of rows "
            f"in flight needs at least one cache row). Fix: serve.microbatches={min(max(g, 1), serve_cfg.max_batch)} "
            f"or leave it unset (one group per pipeline rank), or raise serve.max_batch."
        )
    return g


def fit_problem(index: int, prompt: List[int], max_new: int, max_context: int, where: str) -> Optional[str]:
    """Why a request cannot be served with these limits (None when it fits). `where` names it (a line, a prompt)."""
    need = len(prompt) + max_new
    if need > max_context:
        hi = upper_bound(ServeConfig, "max_context")  # a hint never suggests a value the schema refuses
        raise_it = f"serve.max_context={need} or more, or " if hi is None or need <= hi else ""
        return (
            f"{where} is {len(prompt)} tokens; with max_new_tokens={max_new} it exceeds serve.max_context="
            f"{max_context}. Fix: {raise_it}shorten the prompt / lower its max_new_tokens."
        )
    return None


def check_prompts(prompts: List[List[int]], vocab_size: int) -> None:
    """Token-id prompts must be non-empty and stay in the vocab (whole-job errors; fit is per request)."""
    for i, p in enumerate(prompts):
        if not p:
            raise ServeError(f"prompt {i} is empty. Fix: every prompt needs at least one token.")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ServeError(
                f"prompt {i} has token id {bad[0]} outside model.vocab_size={vocab_size}. Fix: "
                f"token ids in [0, {vocab_size})."
            )


def requests_of(prompts: List[List[int]], max_new: List[int], max_context: int, vocab_size: int) -> List[Request]:
    """Checked token-id prompts and their limits -> the scheduler's requests, in input order. Raises ServeError."""
    check_prompts(prompts, vocab_size)
    for i, (p, m) in enumerate(zip(prompts, max_new)):
        problem = fit_problem(i, p, m, max_context, f"prompt {i}")
        if problem:
            raise ServeError(problem)
    return [Request(i, list(p), int(m)) for i, (p, m) in enumerate(zip(prompts, max_new))]


def check_graph_blocks(plan: Plan, serve_cfg) -> None:
    """The plan's graph blocks must fit the serve config: one block of each kind at most; decode classes <= the rows
    of one group (serve.max_batch / serve.microbatches); the largest prefill class == serve.prefill_chunk (the index
    cache holds one chunk); the largest mixed class == serve.max_pass_tokens (every mixed pass pads to a class). The
    planner already refused every kind serving does not capture."""
    groups = check_groups(serve_cfg, plan)
    rows = min(b - a for a, b in group_ranges(serve_cfg.max_batch, groups))
    for b in plan.graph_blocks:
        if b.kind == "decode" and max(b.shape_classes) > rows:
            per = (
                f"the {rows} rows of one microbatch group (serve.max_batch={serve_cfg.max_batch} over "
                f"serve.microbatches={groups})"
                if groups > 1
                else f"serve.max_batch={serve_cfg.max_batch}"
            )
            raise ServeError(
                f"graphs.blocks[{b.name}].shape_classes={list(b.shape_classes)} go beyond {per}; the caches hold that "
                f"many rows per group. Fix: drop the classes above {rows}, or set serve.max_batch="
                f"{max(b.shape_classes) * groups}" + (", or serve.microbatches=1." if groups > 1 else ".")
            )
        if b.kind == "prefill" and max(b.shape_classes) != serve_cfg.prefill_chunk:
            raise ServeError(
                f"graphs.blocks[{b.name}].shape_classes={list(b.shape_classes)}: the largest prefill class must equal "
                f"serve.prefill_chunk={serve_cfg.prefill_chunk} (every chunk must fit a class, and the index cache "
                f"holds one chunk). Fix: serve.prefill_chunk={max(b.shape_classes)}, or change the classes."
            )
        budget = getattr(serve_cfg, "max_pass_tokens", None)
        if b.kind == "mixed" and (budget is None or max(b.shape_classes) != budget):
            fix = f"serve.max_pass_tokens={max(b.shape_classes)}" + (
                ", or change the classes." if budget is not None else " (mixed passes), or graphs=decode."
            )
            raise ServeError(
                f"graphs.blocks[{b.name}].shape_classes={list(b.shape_classes)}: the largest mixed class must equal "
                f"serve.max_pass_tokens={budget} (every mixed pass is padded to a class, and the index cache holds "
                f"one pass). Fix: {fix}"
            )
    kinds = [b.kind for b in plan.graph_blocks]
    for k in SERVED_KINDS:
        if kinds.count(k) > 1:
            raise ServeError(f"graphs.blocks has {kinds.count(k)} blocks of kind={k}. Fix: keep one per kind.")


def check_transfers(graphs_cfg, plan: Plan, device_type: Optional[str]) -> None:
    """graphs.transfers needs CUDA, a decode block (whose shape classes its transfers are padded to) and transfers
    between ranks to replay."""
    if not graphs_cfg.transfers:
        return
    if device_type == "cpu":
        raise ServeError(
            "graphs.transfers=true replays NCCL transfers from CUDA graphs, but the workers run on cpu. Fix: "
            "graphs.transfers=false on CPU."
        )
    if not any(b.kind == "decode" for b in plan.graph_blocks):
        raise ServeError(
            f"graphs.transfers=true pads each decode tick's transfers to the decode block's shape classes, but "
            f"graphs={graphs_cfg.name} has no decode block. Fix: graphs=decode or graphs=decode_prefill, or "
            "graphs.transfers=false."
        )
    if plan.pipeline.ranks == 1:
        raise ServeError(
            "graphs.transfers=true replays the transfers between pipeline ranks, but this plan runs every stage on "
            "one rank. Fix: graphs.transfers=false, or a pipeline of 2 or more ranks (pipeline=pp2)."
        )


def check_mixed_passes(serve_cfg, plan: Plan) -> None:
    """serve.max_pass_tokens (mixed passes, dsaflow.serve.mixed) needs continuous batching, a budget above the rows
    of one group (every decoding row's token plus some prompt), no prefill graph block (mixed passes replay the mixed
    block's graphs, graphs=decode_mixed, or run eagerly, never the prefill graphs) and no short-prefill paths (a mixed
    pass attends sparsely, token-major)."""
    budget = getattr(serve_cfg, "max_pass_tokens", None)
    if budget is None:
        return
    rows = max(b - a for a, b in group_ranges(serve_cfg.max_batch, serve_groups(serve_cfg, plan)))
    problems = []
    if str(serve_cfg.batching) != "continuous":
        problems.append(
            "it mixes joining rows into decode passes, which serve.batching=fixed never has. Fix: "
            "serve.batching=continuous, or serve.max_pass_tokens=null"
        )
    if budget <= rows:
        problems.append(
            f"a pass must hold the next token of each of the {rows} rows of a group and at least one "
            f"prompt token. Fix: serve.max_pass_tokens={rows + 1} or more (or fewer rows per group)"
        )
    if any(b.kind == "prefill" for b in plan.graph_blocks):
        problems.append(
            "mixed passes never replay the prefill graphs of graphs.blocks. Fix: graphs=decode (mixed passes "
            "eager) or graphs=decode_mixed (mixed passes from graphs of token-count classes), or "
            "serve.max_pass_tokens=null"
        )
    if serve_cfg.short_prefill:
        problems.append(
            "the short-prefill paths attend over [rows, T] prefill passes, and every prefill then runs in "
            "token-major mixed passes. Fix: serve.short_prefill=false, or serve.max_pass_tokens=null"
        )
    if problems:
        raise ServeError(f"serve.max_pass_tokens={budget}: " + "; ".join(problems) + ".")
