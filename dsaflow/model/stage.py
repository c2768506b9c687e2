"""A contiguous span of the DSA transformer: the whole model, or one pipeline stage cut from it.

`StageModule(model_cfg, layers, is_first=True, is_last=True, seed=0)`:
  layers  nn.ModuleDict keyed by the GLOBAL layer index (str), one DSABlock per LayerSpec (index, role, source);
  embed   nn.Embedding(vocab, dim) when is_first (else None);
  norm    RMSNorm(dim) + head Linear(dim, vocab) when is_last (else None);
  mtp     nn.ModuleDict of the model's `model.mtp_layers` MTPLayers (dsaflow.model.mtp) keyed by global index, on the
          last stage (else None); a training forward given `mtp_tokens` runs them too.
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
from .context import ATTN_MODES, RECOMPUTE_MODES, CachedContext, ForwardContext, TrainContext
from .dense_prefill import PrefillHint
from .indexer_loss import IndexerLossInBackward, IndexerLossRecorder
from .init import init_stage_weights
from .layer_spec import LayerSpec
from .loss_head import chunked_lm_loss
from .mtp import MTPLayer, mtp_inputs, mtp_layer_indices
from .norms import RMSNorm
from .rope import RopeTables


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
        of an F layer on an earlier stage (cross-stage indices), handed to each forward's `indices_in`."""
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
        mtp = {str(i): MTPLayer(model_cfg, i) for i in mtp_layer_indices(model_cfg)} if self.is_last else {}
        self.mtp = nn.ModuleDict(mtp) if mtp else None
        if model_cfg.tie_embeddings:
            if not (self.is_first and self.is_last):
                raise ValueError(
                    f"model.tie_embeddings=true needs the embedding and the LM head on one stage, but {name} holds only "
                    f"one of them: set model.tie_embeddings=false or use a single pipeline stage."
                )
            self.head.weight = self.embed.weight
        # Training-time indexer KL loss (see dsaflow.model.indexer_loss); the forward kwarg overrides the attribute.
        self.compute_indexer_loss = False
        # train.recompute: "none" | "attention" | "block" (see TrainContext.recompute); the trainer sets it.
        self.recompute = "none"
        self.recompute_chunk_tokens = TrainConfig.recompute_chunk_tokens  # queries per recomputed attention chunk
        # True (the trainer sets it): forward_train on the last stage returns the final hidden state and the loss
        # applies norm and head in chunks (`lm_loss`), so no [B, T, vocab] logits exist
        self.head_in_loss = False
        # context parallel (dsaflow.model.context_parallel.ContextParallel; the trainer sets it): forward_train
        # takes this rank's zigzag shard of each sequence, at its global positions; None: whole sequences
        self.cp = None
        self.indexer_loss: Optional[torch.Tensor] = None
        self.indices_out: Optional[torch.Tensor] = None
        self.head_input: Optional[torch.Tensor] = None  # last stage with MTP layers: the last forward's norm(h)
        self.rope_tables = RopeTables.of(model_cfg)  # the rotary constants, computed once, not per forward
        self.init_weights(seed)

    def init_weights(self, seed: int) -> None:
        """Per-layer seeded init: stages built separately get exactly the PP=1 weights for the same seed."""
        init_stage_weights(self, seed, self.cfg.init_std)

    def forward_train(
        self,
        x: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
        *,
        attn: str = "sparse",
        indices_in: Optional[torch.Tensor] = None,
        compute_indexer_loss: Optional[bool] = None,
        indexer_loss_in_backward: Optional[IndexerLossInBackward] = None,
        record_expert_load: bool = False,
        mtp_tokens: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """A forward without a cache (training, evaluation, the dense warm-up): the keys are the T tokens themselves.

        x: token ids [B, T] int64 on the first stage, hidden [B, T, dim] otherwise. positions [B, T] int64 (< 0 =
        padding query; default arange(T): token t at position t). attn: "sparse" (indexer top-k) | "dense" (every
        causal key). indices_in: see `_begin_slot`. Returns hidden [B, T, dim], or fp32 logits [B, T, vocab] on the
        last stage (its final hidden state [B, T, dim] before the norm when `head_in_loss`: see `lm_loss`). Sets
        `self.indexer_loss` (scalar, graph only through indexer weights) when training with the indexer loss on (`compute_indexer_loss`, default the attribute of that name), else None.
        indexer_loss_in_backward (train mode, grad enabled, sparse attention; implies compute_indexer_loss): the loss
        runs inside this forward's backward instead (dsaflow.model.indexer_loss): the attention's backward fills its
        target, `self.indexer_loss` stays None, and the values go to `indexer_loss_in_backward.values`.
        record_expert_load: MoE layers count their routed tokens and attach their balance loss (a training forward
        of the pipeline runtime; `dsaflow.model.moe`).
        mtp_tokens [B, T] int64: the microbatch's input ids, on a last stage with MTP layers: they run too, and the
        output is fp32 logits [B, 1 + mtp_layers, T, vocab] (index 0 the model's, index k MTP depth k's;
        dsaflow.model.mtp), or with `head_in_loss` the hidden states [B, 1 + mtp_layers, T, dim] the loss turns into
        them (`_last_stage_output`). Their F layers join the indexer loss."""
        self._check_attn_and_indices(attn, indices_in)
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={self.recompute!r} is not a recompute mode: use one of {RECOMPUTE_MODES}.")
        want_loss = self._wants_indexer_loss(attn, compute_indexer_loss, indexer_loss_in_backward)
        h = self.embed(x) if self.embed is not None else x
        B, T = h.shape[:2]
        causal_rows = no_padding = positions is None and self.cp is None  # TrainContext.causal_rows (dense only)
        if self.cp is not None:
            positions = self._cp_positions(positions, attn, B, T, h.device)
        if positions is None:
            positions = torch.arange(T, device=h.device).expand(B, T)
        elif attn == "dense":  # caller-given positions (padding): one host sync, a rare path
            row = torch.arange(T, device=positions.device)
            causal_rows = bool(((positions == row) | (positions < 0)).all())
        # Distillation is stage-local: S layers reading an earlier stage's indices add nothing to any target here.
        own = [(layer, src) for layer, src in self.sources() if src != self.incoming_source]
        run_mtp = mtp_tokens is not None and self.mtp is not None
        own += [(int(i), int(i)) for i in self.mtp or ()] if run_mtp else []
        recorder = IndexerLossRecorder(own, indexer_loss_in_backward) if want_loss and self.training else None
        rope_mla, rope_index = self.rope_tables(positions)
        ctx = TrainContext(
            positions,
            rope_mla,
            rope_index,
            attn,
            self._begin_slot(IndexSlot(), indices_in, attn),
            recorder=recorder,
            causal_rows=causal_rows,
            no_padding=no_padding,
            recompute=self.recompute,
            recompute_chunk_tokens=self.recompute_chunk_tokens,
            record_expert_load=record_expert_load,
            cp=self.cp,
        )
        out = self._run_layers(h, ctx, logits=not self.head_in_loss, mtp_tokens=mtp_tokens if run_mtp else None)
        self.indexer_loss = recorder.loss() if recorder is not None else None
        return out

    forward = forward_train  # what `module(x)` runs (torch.distributed.pipelining calls the stage so)

    def _cp_positions(self, positions, attn: str, B: int, T: int, device) -> torch.Tensor:
        """Context parallel: the global positions of this rank's shard (sparse attention only; the dense warm-up
        attends per head over whole sequences)."""
        if positions is not None or attn != "sparse":
            raise ValueError(
                f"a context-parallel forward (cp={self.cp.size}) runs sparse attention at the positions of its zigzag "
                f"shard, got attn={attn!r}, positions given={positions is not None}."
            )
        return self.cp.positions(B, T, device)

    def _wants_indexer_loss(self, attn: str, compute: Optional[bool], in_backward) -> bool:
        """Whether a forward without a cache computes the indexer loss (`forward_train`'s arguments)."""
        if in_backward is None:
            return self.compute_indexer_loss if compute is None else compute
        if attn != "sparse" or not (self.training and torch.is_grad_enabled()):
            raise ValueError(
                f"indexer_loss_in_backward needs a training forward (train mode, grad enabled) with sparse "
                f"attention, got attn={attn!r}, training={self.training}, grad={torch.is_grad_enabled()}: leave "
                f"it None and read `indexer_loss` after the forward."
            )
        return True

    def forward_prefill(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: StageCache,
        *,
        indices_in: Optional[torch.Tensor] = None,
        hint: Optional[PrefillHint] = None,
        token_rows: Optional[torch.Tensor] = None,
        attn: str = "sparse",
    ) -> torch.Tensor:
        """A serving pass of prompt chunks over `cache`: each token's rows are written at its position, then every
        query attends over the cached rows. Run it under torch.no_grad(); CUDA-graph safe (no host sync, static
        shapes given x.shape).

        x: token ids [B, T] int64 on the first stage, hidden [B, T, dim] otherwise; positions [B, T] int64 (< 0 =
        padding). indices_in: see `_begin_slot`. Returns hidden [B, T, dim], or fp32 logits [B, T, vocab].
        hint (sparse attention, T > 1): a `PrefillHint` from `dense_prefill.plan_prefill` over the host-known
        positions: the chunk attends over the non-absorbed heads (dense, or masked by the top-k). It must bound every
        position (the caller knows them; nothing is checked on the device, which would sync).
        token_rows int64 [B, T] (no hint): a token-major pass, token (b, t) writes and reads cache row token_rows[b, t]
        (tokens of many rows side by side, e.g. decode tokens and prefill chunks in one [1, N] batch;
        `MLA._forward_token_major`). None: token (b, t) is cache row b's.
        attn: "sparse" (indexer top-k) | "dense" (every causal key, a reference path)."""
        self._check_cached(positions, attn, indices_in, "forward_prefill")
        B, T = x.shape[:2]
        if hint is not None and (attn != "sparse" or T < 2):
            raise ValueError(
                f"hint={hint} is a hint for serving prefill chunks (attn='sparse', T > 1), got attn={attn!r}, T={T}: "
                f"leave it None."
            )
        if token_rows is not None and (hint is not None or token_rows.shape != (B, T)):
            raise ValueError(
                f"token_rows {tuple(token_rows.shape)} addresses cache rows per token: it needs no prefill hint and "
                f"the tokens' shape [{B}, {T}], got hint={hint}."
            )
        return self._run_cached(x, positions, cache, attn, indices_in, hint, token_rows)

    def forward_decode(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: StageCache,
        *,
        indices_in: Optional[torch.Tensor] = None,
        attn: str = "sparse",
    ) -> torch.Tensor:
        """One serving decode step over `cache`: x [B, 1] token ids (first stage) or hidden [B, 1, dim], positions
        [B, 1] int64 (< 0 = an idle row). Writes each token's rows at its position and attends over the cached rows.
        Run it under torch.no_grad(); CUDA-graph safe. indices_in: see `_begin_slot`. Returns hidden [B, 1, dim], or
        fp32 logits [B, 1, vocab]."""
        self._check_cached(positions, attn, indices_in, "forward_decode")
        if x.shape[1] != 1:
            raise ValueError(
                f"forward_decode runs one token per row, got x of shape {tuple(x.shape)}: send chunks of several "
                f"tokens through forward_prefill."
            )
        return self._run_cached(x, positions, cache, attn, indices_in)

    def _check_attn_and_indices(self, attn: str, indices_in: Optional[torch.Tensor]) -> None:
        if attn not in ATTN_MODES:
            raise ValueError(f"attn={attn!r} is not an attention mode: use one of {ATTN_MODES}.")
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

    def _check_cached(self, positions, attn: str, indices_in: Optional[torch.Tensor], method: str) -> None:
        self._check_attn_and_indices(attn, indices_in)
        if positions is None:
            raise ValueError(f"StageModule.{method} needs positions [B, T] (absolute, < 0 = padding).")

    def _begin_slot(self, slot: IndexSlot, indices_in: Optional[torch.Tensor], attn: str) -> IndexSlot:
        """`slot` begun for a new forward. indices_in int32 [B, T, topk] (no gradient), or trimmed to fewer columns
        (`trim_indices`): the top-k indices of `self.incoming_source`, an F layer of an earlier stage, for a stage
        built with receives_indices (required with sparse attention; dense attention reads none). The slot then
        holds them (a serving cache's slot copies them into its static buffer)."""
        slot.begin()
        if indices_in is not None and attn == "sparse":
            topk = self.cfg.index_topk
            if indices_in.shape[-1] < topk:  # sent trimmed (`trim_indices`): the cut columns were -1
                indices_in = F.pad(indices_in, (0, topk - indices_in.shape[-1]), value=-1)
            slot.write(self.incoming_source, indices_in.detach())
        return slot

    def _run_cached(self, x, positions, cache: StageCache, attn: str, indices_in, hint=None, token_rows=None):
        """The serving forwards' common part: the context over `cache`, then the block loop."""
        h = self.embed(x) if self.embed is not None else x
        slot = self._begin_slot(cache.index_slot, indices_in, attn)
        rope_mla, rope_index = self.rope_tables(positions)
        ctx = CachedContext(positions, rope_mla, rope_index, attn, slot, cache, prefill=hint, token_rows=token_rows)
        self.indexer_loss = None
        return self._run_layers(h, ctx)

    def _run_layers(self, h: torch.Tensor, ctx: ForwardContext, logits: bool = True, mtp_tokens=None) -> torch.Tensor:
        """The block loop of every forward: h [B, T, dim] through the stage's layers over `ctx`, then on the last
        stage `_last_stage_output`. Leaves the next stage's indices in `indices_out`."""
        for layer in self.layers.values():
            h = layer(h, ctx)
        self.indices_out = ctx.index_slot.indices if ctx.attn == "sparse" else None
        if self.head is None:
            return h
        return self._last_stage_output(h, ctx, logits, mtp_tokens)

    def _last_stage_output(self, h: torch.Tensor, ctx: ForwardContext, logits: bool, mtp_tokens) -> torch.Tensor:
        """The last layer's output h [B, T, dim] -> what the last stage returns:
        logits=True:  fp32 logits head(norm(h)) [B, T, vocab]; with mtp_tokens [B, T] the MTP depths' too,
                      [B, 1 + mtp_layers, T, vocab] (index k: depth k's head(h_k)).
        logits=False (head_in_loss; the loss applies the head in chunks, `lm_loss`): h itself; with mtp_tokens
                      [B, 1 + mtp_layers, T, dim], what the head reads at each depth: index 0 norm(h) (the
                      final norm applied here, once, since depth 1 reads it too), index k depth k's output h_k (normed
                      by its head_norm, `MTPLayer.predict`); the loss applies no norm to any of them. (One norm node
                      for norm.weight, not two: torch's split backward, `stage_backward_weight`, mis-groups a weight
                      used both by a norm and inside the loss head's autograd Function.)"""
        normed = self.norm(h) if logits or mtp_tokens is not None else None
        # what MTP drafting extends (dsaflow.serve.speculative; cached forwards, which return logits)
        self.head_input = normed if self.mtp is not None and logits else None
        if mtp_tokens is None:
            return self.head(normed).float() if logits else h
        depths = [self.head(normed).float() if logits else normed]
        for depth, layer in enumerate(self.mtp.values(), start=1):
            normed = layer.predict(normed, mtp_inputs(mtp_tokens, depth), ctx)
            depths.append(self.head(normed).float() if logits else normed)
        return torch.stack(depths, dim=1)  # dtypes promote (autocast may leave h fp32 and h_k bf16)

    def lm_loss(
        self,
        hidden: torch.Tensor,
        target: torch.Tensor,
        chunk_tokens: int,
        want_argmax: bool = False,
        reduction="mean",
        normed: bool = False,
    ):
        """Last stage: cross-entropy of head(norm(hidden)) against target [B, T] (-100 = ignored), its mean or sum
        (`reduction`), computed `chunk_tokens` rows at a time (dsaflow.model.loss_head), from hidden [B, T, dim], the
        output of `forward_train` with `head_in_loss`. normed=True: hidden is an MTP depth's output, already normed
        by its head_norm, so the head reads it as is. Returns (loss, argmax [B, T] or None)."""
        norm_weight = None if normed else self.norm.weight
        return chunked_lm_loss(
            hidden, norm_weight, self.head.weight, target, chunk_tokens, self.norm.eps, want_argmax, reduction
        )

    def forward_with_indices(self, x: torch.Tensor, indices_in: Optional[torch.Tensor] = None, **kwargs):
        """`forward_train` -> (its output, `take_indices`): what the pipeline runtime sends on."""
        out = self.forward_train(x, indices_in=indices_in, **kwargs)
        return out, self.take_indices(out)

    def take_indices(self, out: torch.Tensor) -> torch.Tensor:
        """After a forward that returned `out` [B, T, ...]: int32 [B, T, topk], the indices the next stage's opening
        S layers read (those of this stage's last F layer, or the incoming ones if it has none). Dense attention
        writes no indices: they are then -1 everywhere (same shape, so pipeline buffers keep one shape). Clears
        `indices_out`."""
        idx = self.indices_out
        if idx is None:
            B, T = out.shape[:2]
            idx = torch.full((B, T, self.cfg.index_topk), -1, dtype=torch.int32, device=out.device)
        self.indices_out = None
        return idx

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
