"""One pipeline rank's training machinery: stages, schedule, optimisers, data; `step()` and `evaluate()`.

Every rank runs the same sequence of calls; only the rank holding stage 0 feeds inputs and only the rank holding
the last stage feeds targets and sees losses. Per-step metrics that live on other ranks (stage compute time,
indexer loss) reach the logging rank through one small all-reduce.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from dsaflow.config.moe_schema import is_moe_layer
from dsaflow.data import BatchSource
from dsaflow.data.hf_tokenizer import checkpoint_tokenizer
from dsaflow.model import StageModule
from dsaflow.pipeline.run_context import RunContext
from dsaflow.pipeline.stages import stage_module

from .expert_balance import ExpertBalance
from .forward_pass import ForwardPipeline
from .metrics import model_flops_per_token, peak_tflops_per_rank
from .nonfinite import nonfinite_flag
from .optim import advance, build_optimizers, build_schedulers, clip_global
from .pipeline import LMLoss, TrainStage, build_pipeline_stages, build_schedule


def enable_determinism() -> None:
    """train.deterministic: fixed reduction orders for this process. cuBLAS needs its workspace config before its
    first handle is created (no matmul has run yet when the Trainer is built); torch's mode also switches the
    sparse-attention backward (dsaflow.ops.sparse_mla.determinism) and the indexer loss to their fixed-order
    paths. warn_only: an op without a deterministic implementation warns (naming itself) instead of stopping."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


class Trainer:
    def __init__(self, ctx: RunContext):
        self.ctx, cfg, plan = ctx, ctx.cfg, ctx.plan
        self.t = t = cfg.train
        torch.manual_seed(t.seed)
        if t.deterministic:
            enable_determinism()
        self.local = ctx.stages
        self.modules: List[StageModule] = [
            stage_module(cfg.model, plan, s.index, t.seed).to(ctx.device) for s in self.local
        ]
        for m in self.modules:
            m.recompute, m.recompute_chunk_tokens = str(t.recompute), t.recompute_chunk_tokens
        self.wrappers = [
            TrainStage(m, t.indexer_loss_weight, plan.sends_indices(s.index)) for m, s in zip(self.modules, self.local)
        ]
        self.pstages = build_pipeline_stages(
            self.wrappers, [s.index for s in self.local], plan.num_stages, ctx.device, ctx.group
        )
        self.data = BatchSource(
            cfg.data, t.seq_len, t.batch_size, t.seed, cfg.model.vocab_size, checkpoint_tokenizer(cfg.model.hf_path)
        )
        self.loss_fn = LMLoss(cfg.data.num_queries if self.data.has_answers else 0)
        self.schedule = build_schedule(plan.pipeline.schedule, self.pstages, plan.pipeline.microbatches, self.loss_fn)
        self.forward_only = ForwardPipeline(
            ctx, self.modules, [s.index for s in self.local], [ps.timer for ps in self.pstages]
        )
        self.opt = build_optimizers(self.modules, t)
        self.scheds = build_schedulers(self.opt, t)
        self.has_first = any(plan.is_first(s.index) for s in self.local)
        self.has_last = any(plan.is_last(s.index) for s in self.local)
        use_bf16 = t.dtype == "bf16" or (t.dtype == "auto" and ctx.is_cuda)
        self.autocast = (
            (lambda: torch.autocast(ctx.device.type, dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
        )
        self.tokens_per_step = t.batch_size * t.seq_len
        m = cfg.model
        self.balance = ExpertBalance(self.modules, m.num_layers, m.moe.bias_update_rate if m.moe else 0.0)
        self.moe_layer_ids = [i for i in range(m.num_layers) if is_moe_layer(m, i)]
        self._count_params()

    def _count_params(self) -> None:
        n = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        for m in self.modules:
            n[0] += sum(p.numel() for p in m.parameters())
            if m.embed is not None:
                n[1] += m.embed.weight.numel()
        dist.all_reduce(n, group=self.ctx.group)
        self.params, self.embedding_params = int(n[0]), int(n[1])
        peak = peak_tflops_per_rank(self.t, self.ctx.device)
        self.peak_flops = None if peak is None else peak * 1e12 * self.ctx.plan.pipeline.ranks
        self.flops_per_token = model_flops_per_token(
            self.ctx.cfg.model, self.ctx.plan, self.t.seq_len, self.params, self.embedding_params
        )

    def start_at(self, step: int) -> None:
        """Resume: the next update is step `step` (call after the checkpoint restored the optimiser state)."""
        self.scheds = build_schedulers(self.opt, self.t, step)

    def dense_phase(self, step: int) -> bool:
        """dense_warmup: dense attention, only the indexers learn (main model frozen)."""
        return self.t.dsa_stage == "dense_warmup" or step < self.t.dense_warmup_steps

    def _run_schedule(self, x, y, losses: list) -> None:
        args = (x.to(self.ctx.device),) if self.has_first else ()
        kwargs = {"target": y.to(self.ctx.device), "losses": losses} if self.has_last else {}
        with self.autocast():
            self.schedule.step(*args, **kwargs)

    def _run_forward(self, x, y, losses: list, attn: str, learn: bool) -> None:
        sinks = {sp.index: w.indexer_losses for sp, w in zip(self.local, self.wrappers)}
        self.forward_only.run(
            x if self.has_first else None,
            y if self.has_last else None,
            losses,
            self.loss_fn,
            self.autocast,
            attn,
            self.t.indexer_loss_weight if learn else None,
            sinks,
        )

    def step(self, step: int) -> Dict[str, float]:
        """One optimiser step on batch `step`. Returns metrics (complete on the logging rank)."""
        t0 = time.perf_counter()
        dense = self.dense_phase(step)
        for w in self.wrappers:
            w.attn = "dense" if dense else "sparse"
            w.indexer_losses.clear()
        for s in self.pstages:
            s.timer.reset()
        for o in (self.opt.main, self.opt.indexer):
            o.zero_grad(set_to_none=True)
        self.loss_fn.reset()
        x, y = self.data.batch(step)
        losses: list = []
        if dense:  # frozen main model: each stage backpropagates only its indexer loss (no pipeline backward)
            self._run_forward(x, y, losses, "dense", learn=True)
        else:
            self._run_schedule(x, y, losses)
        grad_norm, idx_norm = clip_global(self.opt, self.t.grad_clip, self.ctx.device, self.ctx.group)
        lr = self.opt.main.param_groups[0]["lr"]  # this step's lr (the schedulers advance after the updates)
        # A non-finite global norm (the same on every rank) skips that optimiser's update everywhere: one bad
        # batch must not turn the weights into NaN. The skip is logged (`skipped_main`, `skipped_indexer`).
        skip_main, skip_idx = not math.isfinite(grad_norm), not math.isfinite(idx_norm)
        if not dense and not skip_main:
            self.opt.main.step()
        if not skip_idx:
            self.opt.indexer.step()
        advance(self.scheds)

        S, R = self.ctx.plan.num_stages, self.ctx.plan.pipeline.ranks
        nf_slot = 2 * S + R  # the non-finite flag's slot; expert balance after it
        vec = torch.zeros(nf_slot + 1 + self.balance.width(), dtype=torch.float64, device=self.ctx.device)
        self.balance.after_step(vec[nf_slot + 1 :], update=not dense and not skip_main)
        if self.ctx.is_cuda:  # peak device memory of this rank since the run started (weights, optimiser, activations)
            vec[2 * S + self.ctx.rank % R] = torch.cuda.max_memory_allocated(self.ctx.device) / 2**30
        for ps, w, sp in zip(self.pstages, self.wrappers, self.local):
            vec[sp.index] = ps.timer.seconds()
            if w.indexer_losses:
                vec[S + sp.index] = torch.stack(w.indexer_losses).mean().double()
        vec[nf_slot] = nonfinite_flag([*losses, *(x for w in self.wrappers for x in w.indexer_losses)], vec.device)
        dist.all_reduce(vec, group=self.ctx.group)
        if self.ctx.is_cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        busy = vec[:S].tolist()
        m: Dict[str, float] = {
            "lr": lr,
            "grad_norm": grad_norm,
            "indexer_grad_norm": idx_norm,
            "dense": float(dense),
            "skipped_main": float(skip_main),
            "skipped_indexer": float(skip_idx),
            "step_time_s": wall,
            "tokens_per_s": self.tokens_per_step / wall,
            "indexer_loss": float(vec[S : 2 * S].sum()),  # vec = [busy | indexer loss | memory | non-finite | experts]
            "pipeline_efficiency": sum(busy) / (self.ctx.plan.pipeline.ranks * wall),
            "nonfinite_losses": float(vec[nf_slot]),  # > 0: some stage's loss was NaN/inf (train.on_nonfinite decides)
        }
        for s in range(S):
            m[f"stage{s}_time_s"] = busy[s]
            m[f"stage{s}_indexer_loss"] = float(vec[S + s])
        if self.ctx.is_cuda:
            for r in range(R):
                m[f"rank{r}_peak_mem_gib"] = float(vec[2 * S + r])
        m.update(self.balance.metrics(vec[nf_slot + 1 :], self.moe_layer_ids))
        if self.peak_flops:
            m["mfu"] = self.flops_per_token * m["tokens_per_s"] / self.peak_flops
        if self.has_last:
            m["loss"] = float(torch.stack([l.detach().float() for l in losses]).mean())
            if self.data.has_answers:
                m["acc"] = self.loss_fn.accuracy()
        return m

    def evaluate(self, step: int) -> Dict[str, float]:
        """Mean LM loss and retrieval exact-match accuracy over train.eval_batches held-out batches: forward-only
        pipelined passes without gradients (no backward, so the step's gradients and every training state are
        untouched)."""
        attn = "dense" if self.dense_phase(step) else "sparse"
        self.loss_fn.reset()
        all_losses: List[torch.Tensor] = []
        for i in range(self.t.eval_batches):
            x, y = self.data.val_batch(i)
            self._run_forward(x, y, all_losses, attn, learn=False)
        if not self.has_last:
            return {}
        out = {"eval_loss": float(torch.stack([l.detach().float() for l in all_losses]).mean())}
        if self.data.bytes:  # byte tokens: nats per byte / ln 2 = bits per byte
            out["eval_bpb"] = out["eval_loss"] / math.log(2)
        if self.data.has_answers:
            out["eval_acc"] = self.loss_fn.accuracy()
        return out
