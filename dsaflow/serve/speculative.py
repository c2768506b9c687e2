"""Speculative decoding with the model's MTP layer, in plain torch: `generate_speculative`, the reference that
reference.py's `generate` is for plain decoding (same stages dict, same caches plus the MTP layer's).

Per step, for every active row at position p holding its last token t:
1. verify: [t, d_1 .. d_K] at positions p .. p + K through every stage as one [B, K + 1] pass; the logits at p + j
   predict the token after d_j;
2. accept (dsaflow/serve/speculation.py, greedy): the longest prefix of drafts equal to the target's argmax, n of
   them, plus the target's own token after them: n + 1 tokens, the same as n + 1 plain decode steps would emit;
3. roll back: positions p + n + 1 .. p + K leave every cache (`roll_back_positions`);
4. draft: the MTP layer extends its own cache over the kept positions p .. p + n, each with the target's normed
   hidden state there and the token after it (the layer's row at position i holds (h[i], t[i + 1])); its output at
   p + n gives d'_1, and the layer applied K - 1 more times to its own output and draft (SGLang's chain) gives
   d'_2 .. d'_K at positions p + n + 1 ...
The prompt's prefill runs the MTP layer over the prompt's positions the same way. The drafts come from the first MTP
layer (one layer chained, as released checkpoints use it). Greedy, the output is the model's greedy output whatever
the drafts, which the tests check against `generate`; with temperature > 0 the drafts are sampled from the MTP
layer's distribution and the speculative-sampling rule keeps each token distributed as the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from dsaflow.model import LayerSpec, StageCache, StageModule
from dsaflow.model.cache_rollback import roll_back_positions
from dsaflow.model.context import CachedContext

from .reference import Caches, Stages, forward, prefill
from .sampling import make_generator, top_p_mask
from .speculation import accept_greedy, accept_sampled


def allocate_speculative_caches(stages: Stages, batch: int, max_context: int, max_tokens: int) -> Caches:
    """reference.allocate_caches plus the last stage's MTP layers' rows (each an F layer: latent KV and indexer
    keys)."""
    caches = {}
    for s, stage in stages.items():
        weight = next(stage.parameters())
        layers = [LayerSpec(b.layer_index, b.role, b.source) for b in stage.layers.values()]
        layers += [LayerSpec(int(i), "F", int(i)) for i in stage.mtp or ()]
        caches[s] = StageCache.allocate(stage.cfg, layers, batch, max_context, max_tokens, weight.device, weight.dtype)
    return caches


def mtp_pass(stage: StageModule, cache: StageCache, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
    """The first MTP layer over `cache`: h [B, T, dim] normed hidden states, tokens [B, T] (the token after each),
    positions [B, T] (-1 = padding) -> its normed output [B, T, dim], its rows written at the positions."""
    layer = next(iter(stage.mtp.values()))
    cache.index_slot.begin()
    rope_mla, rope_index = stage.rope_tables(positions)
    ctx = CachedContext(positions, rope_mla, rope_index, "sparse", cache.index_slot, cache)
    return layer.predict(h, tokens, ctx)


class Picker:
    """How tokens are chosen from logits [B, T, V]: greedy at temperature 0, else softmax(logits / temperature)
    cut to the top-p nucleus and sampled with a seeded generator (the exponential race of dsaflow.serve.sampling).
    `pick` -> (tokens [B, T], the distributions they were drawn from [B, T, V], None when greedy)."""

    def __init__(self, temperature: float, top_p: float, seed: int, device):
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"temperature must be >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        self.temperature, self.top_p = temperature, top_p
        self.generator = make_generator(device, seed) if temperature > 0 else None

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1:
            flat = probs.reshape(-1, probs.shape[-1])
            probs = torch.where(top_p_mask(flat, self.top_p), flat, 0.0).reshape(probs.shape)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def race(self, shape, device) -> torch.Tensor:
        return torch.empty(shape, device=device).exponential_(generator=self.generator)

    def pick(self, logits: torch.Tensor):
        if self.generator is None:
            return logits.argmax(dim=-1), None
        probs = self.probs(logits)
        race = self.race(probs.shape, probs.device).clamp_min(torch.finfo(torch.float32).tiny)
        return (probs / race).argmax(dim=-1), probs


def draft(stage, cache, h, tokens, positions, last: torch.Tensor, k: int, picker: Picker):
    """Extend the MTP cache over a pass (h, tokens, positions [B, T]; `mtp_pass`), then chain: -> (drafts [B, k]
    int64, the first from each row's column last[b]; their distributions [B, k, V] when sampling, else None)."""
    rows = torch.arange(h.shape[0], device=h.device)
    g = mtp_pass(stage, cache, h, tokens, positions)[rows, last].unsqueeze(1)
    pos = positions[rows, last].unsqueeze(1)
    drafted = [picker.pick(stage.head(g))]
    for _ in range(k - 1):
        pos = torch.where(pos >= 0, pos + 1, -1)
        g = mtp_pass(stage, cache, g, drafted[-1][0], pos)
        drafted.append(picker.pick(stage.head(g)))
    drafts = torch.cat([d for d, _ in drafted], dim=1)
    return drafts, None if picker.generator is None else torch.cat([q for _, q in drafted], dim=1)


def verify(picker: Picker, logits: torch.Tensor, drafts: torch.Tensor, q: Optional[torch.Tensor]):
    """The acceptance rule (dsaflow.serve.speculation) of a verify pass's logits [B, K + 1, V] -> (n [B], tokens
    [B, K + 1]): greedy, or the speculative-sampling rule against the drafts' distributions q."""
    if picker.generator is None:
        return accept_greedy(logits, drafts)
    B, K = drafts.shape
    uniforms = torch.rand(B, K, device=drafts.device, generator=picker.generator)
    race = picker.race((B, logits.shape[-1]), drafts.device)
    return accept_sampled(picker.probs(logits), q, drafts, uniforms, race)


@dataclass
class SpeculationStats:
    """passes: verify passes per active row, summed; accepted[j]: how many of them accepted draft j + 1."""

    k: int
    passes: int = 0
    accepted: List[int] = field(default_factory=list)

    def add(self, n: torch.Tensor, active: torch.Tensor) -> None:
        n = n[active]
        self.passes += int(n.numel())
        counts = [(n > j).sum().item() for j in range(self.k)]
        self.accepted = [a + c for a, c in zip(self.accepted or [0] * self.k, counts)]

    def summary(self) -> Dict[str, object]:
        """acceptance_rate: accepted drafts / drafted; mean_accept_length: tokens per verify pass (1 + accepted);
        per_position: the acceptance of draft 1 .. K."""
        per = [a / self.passes if self.passes else 0.0 for a in self.accepted or [0] * self.k]
        drafted = self.passes * self.k
        return {
            "acceptance_rate": sum(self.accepted) / drafted if drafted else 0.0,
            "mean_accept_length": 1 + sum(per),
            "per_position": per,
        }


@torch.no_grad()
def generate_speculative(
    stages: Stages,
    caches: Caches,
    prompts: Sequence[Sequence[int]],
    max_new: Sequence[int],
    k: int,
    eos_id: Optional[int] = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> tuple[List[List[int]], SpeculationStats]:
    """Generation with k >= 1 MTP drafts per step -> (generated ids per prompt, the acceptance stats). Greedy at
    temperature 0 (the tokens of reference.generate); otherwise each token is sampled from the target's
    softmax(logits / temperature) cut to top_p, through the speculative-sampling rule (drafts sampled from the MTP
    layer's distribution at the same temperature; one seeded generator, so the tokens depend on the batch). The
    caches come from `allocate_speculative_caches` with max_tokens >= max(longest prompt, k + 1); the last stage
    needs MTP layers."""
    last = stages[max(stages)]
    if last.mtp is None or k < 1:
        raise ValueError(f"generate_speculative needs k >= 1 (got {k}) and a last stage with MTP layers.")
    for c in caches.values():
        c.reset()
    cache = caches[max(stages)]
    device = cache.index.device
    B = len(prompts)
    picker = Picker(temperature, top_p, seed, device)
    token = picker.pick(prefill(stages, caches, prompts))[0]
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    T = int(lengths.max())
    after = torch.zeros(B, T, dtype=torch.long, device=device)  # the token after each prompt position
    positions = torch.full((B, T), -1, dtype=torch.long, device=device)
    for r, p in enumerate(prompts):
        after[r, : len(p) - 1] = torch.tensor(p[1:], dtype=torch.long)
        positions[r, : len(p)] = torch.arange(len(p))
    after[torch.arange(B), lengths - 1] = token
    drafts, q = draft(last, cache, last.head_input, after, positions, lengths - 1, k, picker)
    out: List[List[int]] = [[] for _ in prompts]
    done = _emit(out, [[t] for t in token.tolist()], max_new, eos_id, [False] * B)
    stats, position, cols = SpeculationStats(k), lengths.clone(), torch.arange(k + 1, device=device)
    while not all(done):
        active = ~torch.tensor(done, device=device)
        pos = torch.where(active.unsqueeze(1), position.unsqueeze(1) + cols, -1)
        logits = forward(stages, caches, torch.cat([token.unsqueeze(1), drafts], dim=1), pos)
        n, best = verify(picker, logits, drafts, q)
        stats.add(n, active)
        done = _emit(out, [best[r, : n[r] + 1].tolist() for r in range(B)], max_new, eos_id, done)
        # each row keeps the positions of the tokens it has fed: its prompt and all but its last emitted token
        # (fewer than n + 1 new ones when its limit or EOS came first)
        kept = torch.tensor([len(p) + len(o) - 1 for p, o in zip(prompts, out)], device=device)
        for c in caches.values():
            roll_back_positions(c, kept, position + k + 1, k + 1)
        pos = torch.where(cols <= n.unsqueeze(1), pos, -1)
        drafts, q = draft(last, cache, last.head_input, best, pos, n, k, picker)
        token, position = best[torch.arange(B, device=device), n], kept
    return out, stats


def _emit(out, tokens: List[List[int]], max_new, eos_id, done: List[bool]) -> List[bool]:
    """Append each active row's new tokens up to its limit or EOS -> the rows' done flags."""
    flags = list(done)
    for r, new in enumerate(tokens):
        for t in new if not flags[r] else ():
            out[r].append(t)
            if len(out[r]) == max_new[r] or t == eos_id:
                flags[r] = True
                break
    return flags
