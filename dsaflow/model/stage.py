"""A contiguous span of the DSA transformer: the whole model, or one pipeline stage cut from it.

`StageModule(model_cfg, layers, is_first=True, is_last=True, seed=0)`:
  layers  nn.ModuleDict keyed by the GLOBAL layer index (str), one DSABlock per LayerSpec (index, role, source);
  embed   nn.Embedding(vocab, dim) when is_first (else None);
  norm    RMSNorm(dim) + head Linear(dim, vocab) when is_last (else None).
`build_model(model_cfg)` is the whole model (every layer F unless roles are given). The model knows nothing of plans:
the runtime cuts stages by passing each stage's layers (dsaflow.pipeline.stages). State-dict keys are global and stable,
e.g. `layers.5.attn.wkv_b.weight`, `layers.4.attn.indexer.wk.weight` (docs/model.md lists them all).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dsaflow.config.schema import ModelConfig, TrainConfig

from .block import DSABlock
from .cache import IndexSlot, StageCache
from .context import ATTN_MODES, RECOMPUTE_MODES, ForwardContext
from .dense_prefill import PrefillHint
from .indexer_loss import IndexerLossInBackward, IndexerLossRecorder
from .init import init_stage_weights
from .layer_spec import LayerSpec
from .norms import RMSNorm
from .rope import rope_tables


class StageModule(nn.Module):
    def __init__(
        self,
        model_cfg: ModelConfig,
        layers: Sequence[LayerSpec],
        is_first: bool = True,
        is_last: bool = True,
        seed: int = 0,
        name: str = "stage",
        receives_indices: bool = False,
    ):
        """layers: LayerSpec-like objects (index, role, source) of a contiguous span, in order. `name` only labels
        error messages (e.g. "stage 1"). receives_indices: the S layers that open the span read the top-k indices
        of an F layer on an earlier stage (cross-stage indices), handed to `forward(indices_in=...)`."""
        super().__init__()
        self.cfg, self.is_first, self.is_last = model_cfg, is_first, is_last
        self.incoming_source = _incoming_source(layers, name) if receives_indices else None
        roles = {l.index: l.role for l in layers}
        for l in layers:  # fail closed: an S layer may only reuse indices written earlier in this very span
            if l.role == "S" and l.source == self.incoming_source:
                continue
            if l.role == "S" and not (l.source in roles and l.source < l.index and roles[l.source] == "F"):
                raise ValueError(
                    f"S layer {l.index} on {name} has source={l.source}, which is not an earlier F layer of the same "
                    f"stage (layers {sorted(roles)}): rebuild plan.json with `dsaflow plan`, which promotes such "
                    f"layers to F or, with pipeline.cross_stage_indices=true, sends the indices across."
                )
        self.layers = nn.ModuleDict({str(l.index): DSABlock(model_cfg, l) for l in layers})
        self.embed = nn.Embedding(model_cfg.vocab_size, model_cfg.dim) if self.is_first else None
        self.norm = RMSNorm(model_cfg.dim, model_cfg.norm_eps) if self.is_last else None
        self.head = nn.Linear(model_cfg.dim, model_cfg.vocab_size, bias=False) if self.is_last else None
        if model_cfg.tie_embeddings:
            if not (self.is_first and self.is_last):
                raise ValueError(
                    f"model.tie_embeddings=true needs the embedding and the LM head on one stage, but {name} holds only "
                    f"one of them: set model.tie_embeddings=false or use a single pipeline stage."
                )
            self.head.weight = self.embed.weight
        # Training-time indexer KL loss (see dsaflow.model.indexer_loss); the forward kwarg overrides the attribute.
        self.compute_indexer_loss = False
        # train.recompute: "none" | "attention" | "block" (see ForwardContext.recompute); the trainer sets it.
        self.recompute = "none"
        self.recompute_chunk_tokens = TrainConfig.recompute_chunk_tokens  # queries per recomputed attention chunk
        self.indexer_loss: Optional[torch.Tensor] = None
        self.indices_out: Optional[torch.Tensor] = None
        self.init_weights(seed)

    def init_weights(self, seed: int) -> None:
        """Per-layer seeded init: stages built separately get exactly the PP=1 weights for the same seed."""
        init_stage_weights(self, seed, self.cfg.init_std)

    def forward(
        self,
        x: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        cache: Optional[StageCache] = None,
        attn: str = "sparse",
        compute_indexer_loss: Optional[bool] = None,
        indexer_loss_in_backward: Optional[IndexerLossInBackward] = None,
        indices_in: Optional[torch.Tensor] = None,
        prefill: Optional[PrefillHint] = None,
        record_expert_load: bool = False,
        token_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x: token ids [B, T] int64 on the first stage, hidden [B, T, dim] otherwise.

        positions [B, T] int64 absolute positions (< 0 = padding query). Without a cache the keys are the T tokens
        themselves, token t at position t (default positions = arange(T)); with a cache positions are required and
        each token's rows are written at its position, then every query attends over the cached rows.
        attn: "sparse" (indexer top-k) | "dense" (all causal keys).
        Returns hidden [B, T, dim], or fp32 logits [B, T, vocab] on the last stage. Sets `self.indexer_loss`
        (scalar, graph only through indexer weights) when training with the indexer loss on, else None.
        indexer_loss_in_backward (training, sparse attention, grad enabled; implies compute_indexer_loss): the loss
        runs inside this forward's backward instead (dsaflow.model.indexer_loss): the attention's backward fills its
        target, `self.indexer_loss` stays None, and the values go to `indexer_loss_in_backward.values`.
        With a cache: CUDA-graph safe (no host sync, static shapes given x.shape); run it under torch.no_grad().
        indices_in int32 [B, T, topk] (no gradient): the top-k indices of `self.incoming_source`, an F layer of an
        earlier stage, for a stage built with receives_indices (required with sparse attention; dense attention
        reads none). With a cache they are copied into the stage's static index buffer. After the forward,
        `self.indices_out` holds what the next stage reads (see `forward_with_indices`).
        prefill (with a cache, sparse attention, T > 1): a `PrefillHint` from `dense_prefill.plan_prefill` over the
        host-known positions: this chunk attends over the non-absorbed heads (dense, or masked by the top-k). It must
        bound every position (the caller knows them; nothing is checked on the device, which would sync).
        record_expert_load: MoE layers count their routed tokens and attach their balance loss (a training forward
        of the pipeline runtime; `dsaflow.model.moe`).
        token_rows int64 [B, T] (with a cache, no prefill hint): a token-major pass, token (b, t) writes and reads
        cache row token_rows[b, t] (tokens of many rows side by side, e.g. decode tokens and prefill chunks in one
        [1, N] batch; `MLA._forward_token_major`). None: token (b, t) is cache row b's.
        """
        if attn not in ATTN_MODES:
            raise ValueError(f"attn={attn!r} is not an attention mode: use one of {ATTN_MODES}.")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={self.recompute!r} is not a recompute mode: use one of {RECOMPUTE_MODES}.")
        if indices_in is not None and self.incoming_source is None:
            raise ValueError(
                "indices_in was given, but no S layer of this stage reads an earlier stage's indices "
                "(build it with receives_indices=True from a plan with cross-stage indices)."
            )
        if indices_in is None and self.incoming_source is not None and attn == "sparse":
            raise ValueError(
                f"S layers of this stage read the indices of layer {self.incoming_source} on an earlier "
                f"stage: pass them as indices_in [B, T, topk] int32."
            )
        h = self.embed(x) if self.embed is not None else x
        B, T = h.shape[:2]
        if prefill is not None and (cache is None or attn != "sparse" or T < 2):
            raise ValueError(
                f"prefill={prefill} is a hint for serving prefill chunks (a cache, attn='sparse', T > 1), got "
                f"cache={cache is not None}, attn={attn!r}, T={T}: leave it None."
            )
        if token_rows is not None and (cache is None or prefill is not None or token_rows.shape != (B, T)):
            raise ValueError(
                f"token_rows {tuple(token_rows.shape)} addresses cache rows per token: it needs a cache, no prefill "
                f"hint and the tokens' shape [{B}, {T}], got cache={cache is not None}, prefill={prefill}."
            )
        causal_rows = False  # see ForwardContext.causal_rows (only dense attention reads it)
        no_padding = positions is None
        if positions is None:
            if cache is not None:
                raise ValueError("StageModule.forward with a cache needs positions [B, T] (absolute, < 0 = padding).")
            positions = torch.arange(T, device=h.device).expand(B, T)
            causal_rows = True
        elif cache is None and attn == "dense":  # caller-given positions (padding): one host sync, a rare path
            row = torch.arange(T, device=positions.device)
            causal_rows = bool(((positions == row) | (positions < 0)).all())
        want_loss = self.compute_indexer_loss if compute_indexer_loss is None else compute_indexer_loss
        if indexer_loss_in_backward is not None:
            if attn != "sparse" or cache is not None or not (self.training and torch.is_grad_enabled()):
                raise ValueError(
                    f"indexer_loss_in_backward needs a training forward (train mode, grad enabled, no cache) with "
                    f"sparse attention, got attn={attn!r}, cache={cache is not None}, training={self.training}, "
                    f"grad={torch.is_grad_enabled()}: leave it None and read `indexer_loss` after the forward."
                )
            want_loss = True
        # Distillation is stage-local: S layers reading an earlier stage's indices add nothing to any target here.
        own = [(layer, src) for layer, src in self.sources() if src != self.incoming_source]
        recorder = (
            IndexerLossRecorder(own, indexer_loss_in_backward)
            if (want_loss and self.training and cache is None)
            else None
        )
        slot = cache.index_slot if cache is not None else IndexSlot()
        slot.begin()
        c = self.cfg
        if indices_in is not None and attn == "sparse":
            if indices_in.shape[-1] < c.index_topk:  # sent trimmed (`trim_indices`): the cut columns were -1
                indices_in = F.pad(indices_in, (0, c.index_topk - indices_in.shape[-1]), value=-1)
            slot.write(self.incoming_source, indices_in.detach())
        rope_mla, rope_index = rope_tables(
            positions, c.qk_rope_head_dim, c.index_rope_head_dim, c.rope_theta, c.rope_scaling
        )
        ctx = ForwardContext(
            positions=positions,
            rope_mla=rope_mla,
            rope_index=rope_index,
            attn=attn,
            cache=cache,
            index_slot=slot,
            recorder=recorder,
            causal_rows=causal_rows,
            no_padding=no_padding,
            recompute=self.recompute,
            recompute_chunk_tokens=self.recompute_chunk_tokens,
            prefill=prefill,
            record_expert_load=record_expert_load,
            token_rows=token_rows,
        )
        for layer in self.layers.values():
            h = layer(h, ctx)
        self.indices_out = slot.indices if attn == "sparse" else None
        self.indexer_loss = recorder.loss() if recorder is not None else None
        if self.head is not None:
            return self.head(self.norm(h)).float()
        return h

    def forward_with_indices(self, x: torch.Tensor, indices_in: Optional[torch.Tensor] = None, **kwargs):
        """`forward` -> (its output, indices_out int32 [B, T, topk]): the indices the next stage's opening S layers
        read (those of this stage's last F layer, or the incoming ones if it has none). Dense attention writes no
        indices: indices_out is then -1 everywhere (same shape, so pipeline buffers keep one shape)."""
        out = self.forward(x, indices_in=indices_in, **kwargs)
        idx = self.indices_out
        if idx is None:
            B, T = x.shape[:2]
            idx = torch.full((B, T, self.cfg.index_topk), -1, dtype=torch.int32, device=out.device)
        self.indices_out = None
        return out, idx

    def sources(self) -> List[tuple[int, int]]:
        """(layer, source) for every layer of the stage (source = itself for F layers)."""
        return [(layer.layer_index, layer.source) for layer in self.layers.values()]

    def indexer_parameters(self) -> List[nn.Parameter]:
        """The parameters the indexer loss trains (F layers' `attn.indexer.*`)."""
        return [p for n, p in self.named_parameters() if ".attn.indexer." in n]


def trim_indices(indices: torch.Tensor) -> torch.Tensor:
    """indices [B, T, topk] of a forward without a cache (keys = the T tokens themselves) -> [B, T, min(topk, T)]:
    a query sees at most T keys and `indexer_topk` puts -1 after the selected ones, so the other columns are -1 and
    need not travel (the receiving stage pads them back). What the plan's index payload counts. A new tensor, never
    a view: torch's pipelining detaches stage outputs in place, and a stage without an F layer sends on its input."""
    return indices[..., : min(indices.shape[-1], indices.shape[1])].clone()


def _incoming_source(layers: Sequence[LayerSpec], name: str) -> int:
    """The one F layer of an earlier stage whose indices the S layers opening `layers` read."""
    first = layers[0].index
    opening = []
    for l in layers:
        if l.role == "F":
            break
        opening.append(l)
    sources = {l.source for l in opening}
    if not opening or len(sources) != 1 or min(sources) >= first:
        raise ValueError(
            f"{name} was built with receives_indices=True, but its opening S layers "
            f"{[l.index for l in opening]} do not all read one F layer before layer {first} "
            f"(sources {sorted(sources)})."
        )
    return sources.pop()


def build_model(model_cfg: ModelConfig, roles: Optional[str] = None, seed: int = 0) -> StageModule:
    """The whole model on this process: every layer F, or `roles` ("FSSS...", one letter per layer; each S reads
    the nearest preceding F)."""
    roles = roles or "F" * model_cfg.num_layers
    if len(roles) != model_cfg.num_layers or set(roles) - {"F", "S"} or roles[0] != "F":
        raise ValueError(f"roles={roles!r}: need {model_cfg.num_layers} letters F/S starting with F.")
    specs, last_f = [], 0
    for i, r in enumerate(roles):
        last_f = i if r == "F" else last_f
        specs.append(LayerSpec(i, r, last_f))
    return StageModule(model_cfg, specs, True, True, seed)


def full_state_dict(stages: List[StageModule]) -> Dict[str, torch.Tensor]:
    """Union of the stages' state dicts: the keys are global, so stages never collide (except tied embeddings)."""
    out: Dict[str, torch.Tensor] = {}
    for s in stages:
        out.update(s.state_dict())
    return out


def load_full_state_dict(stage: StageModule, full: Dict[str, torch.Tensor]) -> None:
    """Load this stage's slice of a whole-model state dict (keys it does not own are ignored; missing ones raise)."""
    own = stage.state_dict().keys()
    missing = [k for k in own if k not in full]
    if missing:
        raise KeyError(f"state dict lacks {len(missing)} keys of this stage, e.g. {missing[:3]}")
    stage.load_state_dict({k: full[k] for k in own}, strict=True)
