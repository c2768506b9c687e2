"""Reference generation in plain torch: `prefill`, `decode_one_token` and `generate`. Start reading the serving code
here.

The model is a dict of stages, {stage index: StageModule} in order (dsaflow/model/stage.py), all in this process, each
with its preallocated cache, {stage index: StageCache} (dsaflow/model/cache.py: the latent KV row of every position
per layer, the indexer keys of F layers, the stage's top-k index buffer). One forward of the model runs the stages
one after another over their caches. The hidden state [B, T, dim] goes from each stage to the next. With
pipeline.cross_stage_indices, the top-k indices [B, T, topk] go with it.

Each row of the batch is one prompt. Rows are right-padded to the longest prompt, and a padding token has position
-1: it writes only the cache's trash row and no query sees it. `prefill` runs every prompt at once. Then each
`decode_one_token` feeds every row its last token at its next position. A row that is done idles at position -1.

The serving engine (dsaflow/serve/engine.py) computes the same tokens with more machinery:
- several microbatch groups in flight across pipeline ranks;
- prefill in chunks, mixed with decode steps;
- continuous batching;
- CUDA graphs;
- the short-prefill attention paths (the same attention, summed in another order).

Sampling is the engine's (dsaflow/serve/sampling.py): greedy at temperature 0. Otherwise it draws from keys
(request, token index), so a request gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from dsaflow.model import LayerSpec, StageCache, StageModule

from .sampling import TOKEN_KEY, sample_keyed

Stages = Dict[int, StageModule]
Caches = Dict[int, StageCache]


def allocate_caches(stages: Stages, batch: int, max_context: int, max_tokens: int, kv_dtype: str = "bf16") -> Caches:
    """One StageCache per stage, for `batch` rows of up to `max_context` positions, in the stages' dtype and device
    (kv_dtype="fp8": the packed FP8 caches of serve.kv_dtype=fp8). max_tokens: the most tokens one forward writes per
    row (the longest prompt)."""
    caches = {}
    for s, stage in stages.items():
        weight = next(stage.parameters())
        layers = [LayerSpec(b.layer_index, b.role, b.source) for b in stage.layers.values()]
        caches[s] = StageCache.allocate(
            stage.cfg, layers, batch, max_context, max_tokens, weight.device, weight.dtype, kv_dtype
        )
    return caches


def forward(stages: Stages, caches: Caches, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """tokens [B, T] int64, positions [B, T] int64 (-1 = padding) -> fp32 logits [B, T, vocab]. Every stage writes
    its cache rows at the given positions, then attends over what its cache holds: a decode step when T == 1, else
    a prefill pass."""
    h, indices = tokens, None
    for s, stage in stages.items():
        received = indices if stage.incoming_source is not None else None  # cross-stage indices, if it reads them
        run = stage.forward_decode if tokens.shape[1] == 1 else stage.forward_prefill
        h = run(h, positions, caches[s], indices_in=received)
        indices = stage.take_indices(h)
    return h


@torch.no_grad()
def prefill(stages: Stages, caches: Caches, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Every prompt at once, row r = prompt r (right-padded) -> logits [B, vocab] at each prompt's last token."""
    device = caches[next(iter(caches))].index.device
    B, T = len(prompts), max(len(p) for p in prompts)
    tokens = torch.zeros(B, T, dtype=torch.long, device=device)
    positions = torch.full((B, T), -1, dtype=torch.long, device=device)
    for r, p in enumerate(prompts):
        tokens[r, : len(p)] = torch.tensor(p, dtype=torch.long)
        positions[r, : len(p)] = torch.arange(len(p))
    logits = forward(stages, caches, tokens, positions)
    last = torch.tensor([len(p) - 1 for p in prompts], device=device)
    return logits[torch.arange(B, device=device), last]


@torch.no_grad()
def decode_one_token(stages: Stages, caches: Caches, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """tokens [B] int64 (each row's latest token), positions [B] int64 (where it goes; -1 = an idle row) -> logits
    [B, vocab] for the token after it."""
    return forward(stages, caches, tokens[:, None], positions[:, None])[:, 0]


def sample(logits: torch.Tensor, index: int, temperature: float, top_p: float, seed: int) -> torch.Tensor:
    """logits [B, vocab] of row r = request r -> token ids [B]: the request's `index`-th generated token."""
    requests = torch.arange(logits.shape[0], device=logits.device)
    return sample_keyed(logits, temperature, top_p, seed, requests * TOKEN_KEY + index)


@torch.no_grad()
def generate(
    stages: Stages,
    caches: Caches,
    prompts: Sequence[Sequence[int]],
    max_new: Sequence[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: Optional[int] = None,
) -> List[List[int]]:
    """Token-id prompts, each with its limit of new tokens -> the generated ids of each prompt. A request stops after
    max_new[r] tokens, or after emitting eos_id. The caches need a row per prompt, room for each prompt and its new
    tokens, and the longest prompt in one forward (`allocate_caches`)."""
    cache = caches[next(iter(caches))]
    if len(prompts) > cache.max_batch or max(len(p) for p in prompts) > cache.max_tokens:
        raise ValueError(
            f"{len(prompts)} prompts of up to {max(len(p) for p in prompts)} tokens do not fit caches of "
            f"{cache.max_batch} rows and {cache.max_tokens} tokens per forward: allocate larger caches."
        )
    too_long = [r for r, (p, m) in enumerate(zip(prompts, max_new)) if len(p) + m > cache.max_context]
    if too_long:
        raise ValueError(f"prompts {too_long} and their new tokens exceed max_context={cache.max_context}.")
    for c in caches.values():
        c.reset()
    out: List[List[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    token = sample(prefill(stages, caches, prompts), 0, temperature, top_p, seed)
    position = torch.tensor([len(p) for p in prompts], device=token.device)  # of each row's first new token
    for index in range(max(max_new)):  # token `index` of every row is sampled: keep it, then feed it back
        for r, t in enumerate(token.tolist()):
            if not done[r]:
                out[r].append(t)
                done[r] = len(out[r]) == max_new[r] or t == eos_id
        if all(done):
            break
        idle = torch.tensor(done, device=token.device)
        logits = decode_one_token(stages, caches, token, torch.where(idle, -1, position + index))
        token = sample(logits, index + 1, temperature, top_p, seed)
    return out
