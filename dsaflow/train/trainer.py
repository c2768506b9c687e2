"""Training one pipeline rank: `run_train(ctx)` builds the `Trainer` (stages, schedule, optimisers, data) and runs
its loop (`train()`: resume, steps, evaluation, checkpoints, tracking). `Trainer.step` is one optimiser step on one
screen: zero the gradients, take the batch, run the pipeline schedule, clip, update, advance the lr schedule.

Every rank runs the same sequence of calls; only the rank holding stage 0 feeds inputs and only the rank holding
the last stage feeds targets and sees losses. Per-step metrics that live on other ranks (stage compute time,
indexer loss, expert load) reach the logging rank through one small all-reduce (dsaflow/train/metrics.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from dsaflow.checkpoint.hf_folder import tokenizer_json
from dsaflow.checkpoint.hf_run_copy import hf_files_folder
from dsaflow.checkpoint.store import newest_good_checkpoint
from dsaflow.checkpoint.training_state import load_checkpoint, rank_state, save_checkpoint
from dsaflow.checkpoint.weights import WEIGHTLESS_MODEL_FIELDS, load_model_weights
from dsaflow.data import BatchSource
from dsaflow.data.hf_tokenizer import checkpoint_tokenizer
from dsaflow.errors import CheckpointError
from dsaflow.model import StageModule
from dsaflow.model.context_parallel import zigzag_shard
from dsaflow.model.mtp import mtp_runs_in_training
from dsaflow.pipeline.run_context import RunContext
from dsaflow.pipeline.stages import stage_module
from dsaflow.rundir.folder import checkpoint_dir
from dsaflow.track import Progress, make_tracker

from .cp_comm import context_parallel
from .data_parallel import DataParallel, full_tensor, replica_rows
from .expert_balance import ExpertBalance
from .forward_pass import ForwardPipeline
from .metrics import RunRecords, StepMetrics, count_parameters
from .nonfinite import NonFiniteGuard
from .optim import advance, build_optimizers, build_schedulers, clip_global
from .pipeline import LMLoss, TrainStage, build_pipeline_stages, build_schedule


def enable_determinism() -> None:
    """train.deterministic: fixed reduction orders for this process. cuBLAS needs its workspace config before its
    first handle is created (no matmul has run yet when the Trainer is built); torch's mode also switches the
    sparse-attention backward (dsaflow.ops.sparse_mla.determinism) and the indexer loss to their fixed-order
    paths. warn_only: an op without a deterministic implementation warns (naming itself) instead of stopping."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


def run_train(ctx: RunContext, on_trainer=None) -> list:
    """Train from step 0 (or the latest checkpoint with train.resume=true) to train.steps; returns the logged
    metric records of this rank (complete on the logging rank). `on_trainer(trainer)` lets tests and benchmarks
    inspect the Trainer (gradients, stages) after the run."""
    trainer = Trainer(ctx)
    if on_trainer is not None:
        on_trainer(trainer)
    return trainer.train()


def config_dict(cfg) -> dict:
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


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
        # parallel.cp: each rank runs its zigzag shard of every sequence and gathers the keys over its cp group
        self.cp = context_parallel(ctx.cp_group) if ctx.cp > 1 else None
        for m in self.modules:
            m.recompute, m.recompute_chunk_tokens = str(t.recompute), t.recompute_chunk_tokens
            m.head_in_loss = m.is_last  # the loss applies norm and head in chunks (train.loss_chunk_tokens)
            m.cp = self.cp
        # train.init_from / model.hf_path: whole weights into whole stages, before the dp sharding below
        self.init_lines = [] if t.resume else self._load_initial_weights()
        # parallel.dp: FSDP2-shards the modules over the dp group (before the optimisers see their parameters)
        self.dp = DataParallel(ctx, self.modules)
        self.wrappers = [
            TrainStage(m, t.indexer_loss_weight, plan.sends_indices(s.index), mtp_runs_in_training(cfg))
            for m, s in zip(self.modules, self.local)
        ]
        self.pstages = build_pipeline_stages(
            self.wrappers, [s.index for s in self.local], plan.num_stages, ctx.device, ctx.group
        )
        self.data = BatchSource(
            cfg.data,
            t.seq_len,
            t.batch_size,
            t.seed,
            cfg.model.vocab_size,
            checkpoint_tokenizer(tokenizer_json(hf_files_folder(cfg.model.hf_path, ctx.run_dir))),
        )
        last = [m for m in self.modules if m.is_last]
        self.loss_fn = LMLoss(
            cfg.data.num_queries if self.data.has_answers else 0,
            last[0] if last else None,
            t.loss_chunk_tokens,
            self.cp,
            t.mtp_loss_weight,
        )
        self.schedule = build_schedule(
            plan.pipeline.schedule,
            self.pstages,
            plan.pipeline.microbatches,
            self.loss_fn,
            scale_grads=not self.dp.shard,  # sharded: DataParallel.after_backward divides
        )
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
        self.tokens_per_step = t.batch_size * t.seq_len  # the global batch: every replica's tokens
        moe = cfg.model.moe
        all_layers = cfg.model.num_layers + cfg.model.mtp_layers  # MTP layers have MoE MLPs like any other
        self.balance = ExpertBalance(self.modules, all_layers, moe.bias_update_rate if moe else 0.0)
        self.params, embedding_params = count_parameters(self.modules, ctx.device, ctx.group)
        timed = [(s.index, ps.timer, w.indexer_losses) for s, ps, w in zip(self.local, self.pstages, self.wrappers)]
        self.metrics = StepMetrics(
            ctx, timed, self.loss_fn, self.balance, self.tokens_per_step, self.params, embedding_params
        )

    def start_at(self, step: int) -> None:
        """Resume: the next update is step `step` (call after the checkpoint restored the optimiser state)."""
        self.scheds = build_schedulers(self.opt, self.t, step)

    def dense_phase(self, step: int) -> bool:
        """dense_warmup: dense attention, only the indexers learn (main model frozen)."""
        return self.t.dsa_stage == "dense_warmup" or step < self.t.dense_warmup_steps

    def _replica_batch(self, x, y):
        """This replica's rows of a global batch (all of it at parallel.dp=1), and with parallel.cp this rank's
        zigzag shard of each: x [b, T / cp], y [b, 3, T / cp]."""
        ctx = self.ctx
        x, y = replica_rows(x, ctx.dp, ctx.dp_rank), replica_rows(y, ctx.dp, ctx.dp_rank)
        return zigzag_shard(x, ctx.cp, ctx.cp_rank, dim=1), zigzag_shard(y, ctx.cp, ctx.cp_rank, dim=2)

    def _run_schedule(self, x, y, losses: list) -> None:
        for w in self.wrappers:  # the last stage's MTP layers read the input ids too
            w.feed_mtp_tokens(x.to(self.ctx.device), self.ctx.plan.pipeline.microbatches)
        args = (x.to(self.ctx.device),) if self.has_first else ()
        kwargs = {"target": y.to(self.ctx.device), "losses": losses} if self.has_last else {}
        with self.autocast():
            self.schedule.step(*args, **kwargs)

    def _run_forward(self, x, y, losses: list, attn: str, learn: bool) -> None:
        sinks = {sp.index: w.indexer_losses for sp, w in zip(self.local, self.wrappers)}
        self.forward_only.run(
            x if self.has_first or mtp_runs_in_training(self.ctx.cfg) else None,  # MTP layers read the ids too
            y if self.has_last else None,
            losses,
            self.loss_fn,
            self.autocast,
            attn,
            self.t.indexer_loss_weight if learn else None,
            sinks,
        )

    def step(self, step: int) -> Dict[str, float]:
        """One optimiser step on batch `step`: forward and backward through the pipeline, clip, update, advance the
        lr schedule. Returns metrics (complete on the logging rank)."""
        self.metrics.start()
        for o in (self.opt.main, self.opt.indexer):
            o.zero_grad(set_to_none=True)
        dense = self.dense_phase(step)
        x, y = self._replica_batch(*self.data.batch(step))
        losses: list = []
        # then the gradients are averaged over the dp group (parallel.dp > 1)
        if dense:  # frozen main model: each stage backpropagates only its indexer loss (no pipeline backward)
            self._run_forward(x, y, losses, "dense", learn=True)
            self.dp.after_stage_backward()
        else:
            self._run_schedule(x, y, losses)
            self.dp.after_backward(self.ctx.plan.pipeline.microbatches)  # sharded: also the microbatch mean
        grad_norm, idx_norm = clip_global(self.opt, self.t.grad_clip, self.ctx.device, self.dp.norm_group)
        lr = self.opt.main.param_groups[0]["lr"]  # this step's lr (the schedulers advance after the updates)
        # A non-finite global norm (the same on every rank) skips that optimiser's update everywhere: one bad
        # batch must not turn the weights into NaN. The skip is logged (`skipped_main`, `skipped_indexer`).
        skip_main, skip_idx = not math.isfinite(grad_norm), not math.isfinite(idx_norm)
        if not dense and not skip_main:
            self.opt.main.step()
        if not skip_idx:
            self.opt.indexer.step()
        # after the optimizer step, model updates that follow the new weights. MoE: each layer's selection bias
        # moves against the step's expert load (which the metrics report), when the main model was updated; the
        # load is the global batch's (summed over dp), so every replica moves its biases alike
        self.dp.reduce_expert_load()
        self.balance.after_step(self.metrics.expert_load, update=not dense and not skip_main)
        advance(self.scheds)
        update = {
            "lr": lr,
            "grad_norm": grad_norm,
            "indexer_grad_norm": idx_norm,
            "dense": float(dense),
            "skipped_main": float(skip_main),
            "skipped_indexer": float(skip_idx),
        }
        return self.metrics.finish(update, losses)

    def evaluate(self, step: int) -> Dict[str, float]:
        """Mean LM loss and retrieval exact-match accuracy over train.eval_batches held-out batches: forward-only
        pipelined passes without gradients (no backward, so the step's gradients and every training state are
        untouched)."""
        attn = "dense" if self.dense_phase(step) else "sparse"
        self.loss_fn.reset()
        all_losses: List[torch.Tensor] = []
        for i in range(self.t.eval_batches):
            x, y = self._replica_batch(*self.data.val_batch(i))
            self._run_forward(x, y, all_losses, attn, learn=False)
        self.dp.after_forward_only()
        if not self.has_last:
            return {}
        mtp = self.loss_fn.mtp_losses
        lm_losses = self.loss_fn.lm_losses or all_losses  # with MTP layers, the totals hold their loss too
        mean_loss = torch.stack([l.detach().float() for l in lm_losses]).mean()
        mean_mtp = torch.stack(mtp).float().mean() if mtp else None
        if self.ctx.replicas > 1:  # every replica's (and cp rank's) share: the dp group of the last stage's rank
            counts = (self.loss_fn.correct, self.loss_fn.total)
            sums = torch.stack([mean_loss.double(), *(torch.as_tensor(c, dtype=torch.float64) for c in counts)])
            if mean_mtp is not None:  # MTP runs only at cp=1 (mtp_runs_in_training): the replicas' mean too
                sums = torch.cat([sums, mean_mtp.double().view(1)])
            dist.all_reduce(sums, group=self.ctx.dp_group)
            mean_loss = sums[0] / self.ctx.replicas
            mean_mtp = sums[3] / self.ctx.replicas if mean_mtp is not None else None
            self.loss_fn.correct, self.loss_fn.total = int(sums[1]), int(sums[2])
        out = {"eval_loss": float(mean_loss)}
        if mean_mtp is not None:
            out["eval_mtp_loss"] = float(mean_mtp)
        if self.data.bytes:  # byte tokens: nats per byte / ln 2 = bits per byte
            out["eval_bpb"] = out["eval_loss"] / math.log(2)
        if self.data.has_answers:
            out["eval_acc"] = self.loss_fn.accuracy()
        return out

    def train(self) -> list:
        """The loop: steps from the start (0, or where `restore` resumes) to train.steps, evaluation every
        train.eval_every steps and at the end, a checkpoint every train.ckpt_every steps and at the end, each step's
        record to metrics.jsonl, the tracker and (every train.log_every) train.log. Returns the records."""
        ctx, t = self.ctx, self.t
        records = RunRecords(ctx.run_dir, ctx.is_logging_rank, ctx.rank)
        start = self.restore(records)
        tracker = make_tracker(ctx.cfg, str(ctx.run_dir), ctx.is_logging_rank, resume=t.resume)
        tracker.log_config(config_dict(ctx.cfg), ctx.plan.to_dict())
        progress = Progress(t.steps, start, enabled=ctx.is_logging_rank, mode=t.progress)
        if start:
            progress.message(f"resumed from step {start} ({self.resumed_from.name})")
        header = self.describe()
        progress.message(header)
        records.log(header)
        history, stopped = [], False
        guard = NonFiniteGuard(t.on_nonfinite)

        def say(line: str) -> None:
            progress.message(line)
            records.log(line)

        try:
            for step in range(start, t.steps):
                m = self.step(step)
                done = step + 1
                eval_due = done == t.steps or (t.eval_every and done % t.eval_every == 0)
                if eval_due:
                    m.update(self.evaluate(step))
                record = {"step": done, "time": time.time(), **m}
                records.metrics(record)
                tracker.log(m, step=done)
                history.append(record)
                show = done % t.log_every == 0 or done == t.steps or eval_due
                progress.update(done, m, print_line=show)
                guard.after_step(done, m, say)  # train.on_nonfinite: stop (raises) before anything is saved, or skip
                if show:
                    records.log_step(record)
                if t.ckpt_every and done % t.ckpt_every == 0 and done != t.steps:
                    self.save(done)
                if t.stop_at_step is not None and done == t.stop_at_step and done != t.steps:
                    stopped = True
                    progress.message(f"stopping after step {done} (train.stop_at_step); resume with train.resume=true")
                    break
            if not stopped and t.final_ckpt:
                self.save(t.steps)
        finally:
            progress.close()
            tracker.finish()
            records.close()
        return history

    def describe(self) -> str:
        """The run's header line: parameters, ranks, stages, schedule, microbatches."""
        p = self.ctx.plan
        ranks, stages, mbs = p.pipeline.ranks, p.num_stages, p.pipeline.microbatches
        dp, cp = p.pipeline.dp, p.pipeline.cp
        replicas = ""
        if dp * cp > 1:
            how = "sharded (FSDP2)" if p.pipeline.dp_shard else "replicated"
            split = f" x cp {cp}" if cp > 1 else ""
            replicas = f" x dp {dp}{split} {how} = {p.pipeline.world_size} ranks"
        return (
            f"training {self.params:,} parameters on {ranks} rank{'s' * (ranks != 1)}{replicas} x "
            f"{self.ctx.device.type}, {stages} stage{'s' * (stages != 1)}, schedule {p.pipeline.schedule}, "
            f"{mbs} microbatch{'es' * (mbs != 1)}{' per replica' if dp > 1 else ''}"
        )

    def _load_initial_weights(self) -> List[str]:
        """train.init_from: another run's model weights; model=hf: the Hugging Face checkpoint's. Called before
        `DataParallel` shards the stages, so every rank (each replica too) reads its stages' tensors whole and
        `fully_shard` then keeps its part. Loading after sharding (`set_model_state_dict` with
        `broadcast_from_rank0`) would read each tensor once per dp group and hold less, but a stage that trains
        sharded is first built whole on each rank anyway (stage_module), so reading it whole needs no memory the
        run does not already use, and the same loaders serve every parallel.dp. -> the lines for train.log."""
        ctx, t = self.ctx, self.t
        modules = {s.index: m for s, m in zip(self.local, self.modules)}
        if t.init_from:  # a new run from another run's model weights (checked in the parent: check_init_from)
            ckpt = load_model_weights(modules, t.init_from, ctx.cfg.model, "train.init_from", WEIGHTLESS_MODEL_FIELDS)
            return [f"model weights from {ckpt}; optimiser and schedule start afresh"]
        if not ctx.cfg.model.hf_path:
            return []
        from dsaflow.checkpoint.hf_weights import load_hf_weights

        hf_path, lines = ctx.cfg.model.hf_path, []
        nbytes = load_hf_weights(modules, hf_path, ctx.cfg.model, lines.append)  # this rank's stages' tensors
        # global rank: with parallel.dp > 1 every replica's rank reads its stages' tensors in full
        replica = f" (pp {ctx.rank}, dp {ctx.dp_rank})" if ctx.dp > 1 else ""
        line = (
            f"[rank {ctx.global_rank(ctx.rank)}]{replica} model weights from {hf_path}: read {nbytes / 2**20:.2f} MiB"
        )
        sys.stdout.write(line + "\n")  # one write: the ranks share the launcher's stdout, and print() makes two
        sys.stdout.flush()
        return [*lines, line]

    def restore(self, records: RunRecords) -> int:
        """train.resume: the newest good checkpoint's weights, optimiser and schedule (into the sharded stages with
        parallel.dp_shard). train.init_from and model=hf were loaded before sharding (`_load_initial_weights`); here
        their lines reach train.log. -> the first step to run (0 unless resumed)."""
        ctx, t = self.ctx, self.t
        if t.resume:
            # the parent checked the run (dsaflow.checkpoint.resume.check_resume); every rank picks the same checkpoint
            latest = newest_good_checkpoint(ctx.run_dir, records.log if ctx.is_logging_rank else None)
            if latest is None:
                raise CheckpointError(
                    f"train.resume=true but {ctx.run_dir}/checkpoints holds no good checkpoint. Fix: "
                    "start a new run_dir, or resume a run that saved one."
                )
            start = load_checkpoint(latest[1], self.modules, self.opt, ctx.rank, ctx.group)  # every replica reads it
            self.start_at(start)
            records.truncate_after(start)
            records.log(f"resumed from {latest[1]} at step {start}")
            self.resumed_from = latest[1]
            return start
        for line in self.init_lines:
            records.log(line)
        return 0

    def save(self, step: int) -> None:
        """A checkpoint of every rank's stages, optimisers and step (train.keep_checkpoints prunes older ones).
        With parallel.dp > 1 replica 0 writes it, once per stage, whole: sharded tensors are gathered over the dp
        group first (every replica takes part), so the checkpoint is the one a single replica writes and resumes
        at any parallel.dp."""
        ctx = self.ctx
        state = None
        if ctx.replicas > 1:
            state = {k: full_tensor(v) for k, v in rank_state(self.modules, self.opt, ctx.rank, step, False).items()}
        if ctx.replica_index == 0:
            save_checkpoint(
                checkpoint_dir(ctx.run_dir, step),
                self.modules,
                self.opt,
                ctx.rank,
                step,
                ctx.group,
                self.t.keep_checkpoints,
                state=state,
            )
        if ctx.replicas > 1:  # the other replicas go on once the checkpoint is complete (or its save failed everywhere)
            dist.barrier()
