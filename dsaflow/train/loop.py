"""`run_train(ctx)`: the training loop of one pipeline rank (resume, steps, eval, checkpoints, tracking)."""

from __future__ import annotations

import dataclasses
import time

from dsaflow.checkpoint.store import newest_good_checkpoint
from dsaflow.checkpoint.training_state import load_checkpoint, save_checkpoint
from dsaflow.checkpoint.weights import WEIGHTLESS_MODEL_FIELDS, load_model_weights
from dsaflow.errors import CheckpointError
from dsaflow.pipeline.run_context import RunContext
from dsaflow.rundir.folder import checkpoint_dir
from dsaflow.track import Progress, make_tracker

from .metrics import RunRecords
from .nonfinite import NonFiniteGuard
from .trainer import Trainer


def config_dict(cfg) -> dict:
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def run_train(ctx: RunContext, on_trainer=None) -> list:
    """Train from step 0 (or the latest checkpoint with train.resume=true) to train.steps; returns the logged
    metric records of this rank (complete on the logging rank). `on_trainer(trainer)` lets tests and benchmarks
    inspect the Trainer (gradients, stages) after the run."""
    t = ctx.cfg.train
    tr = Trainer(ctx)
    if on_trainer is not None:
        on_trainer(tr)
    records = RunRecords(ctx.run_dir, ctx.is_logging_rank, ctx.rank)
    start = 0
    if t.resume:
        # the parent checked the run (dsaflow.checkpoint.resume.check_resume); every rank picks the same checkpoint
        latest = newest_good_checkpoint(ctx.run_dir, records.log if ctx.is_logging_rank else None)
        if latest is None:
            raise CheckpointError(
                f"train.resume=true but {ctx.run_dir}/checkpoints holds no good checkpoint. Fix: "
                "start a new run_dir, or resume a run that saved one."
            )
        start = load_checkpoint(latest[1], tr.modules, tr.opt, ctx.rank, ctx.group)
        tr.start_at(start)
        records.truncate_after(start)
        records.log(f"resumed from {latest[1]} at step {start}")
    elif t.init_from:  # a new run from another run's model weights (checked in the parent: check_init_from)
        field = "train.init_from"
        modules = {s.index: m for s, m in zip(ctx.stages, tr.modules)}
        ckpt = load_model_weights(modules, t.init_from, ctx.cfg.model, field, WEIGHTLESS_MODEL_FIELDS)
        records.log(f"model weights from {ckpt}; optimiser and schedule start afresh")
    elif ctx.cfg.model.hf_path:  # model=hf: the checkpoint's own weights, this rank's tensors only
        from dsaflow.checkpoint.hf_weights import load_hf_weights

        hf_path = ctx.cfg.model.hf_path
        nbytes = load_hf_weights(
            {s.index: m for s, m in zip(ctx.stages, tr.modules)}, hf_path, ctx.cfg.model, records.log
        )
        line = f"[rank {ctx.rank}] model weights from {hf_path}: read {nbytes / 2**20:.2f} MiB"
        print(line, flush=True)
        records.log(line)
    tracker = make_tracker(ctx.cfg, str(ctx.run_dir), ctx.is_logging_rank, resume=t.resume)
    tracker.log_config(config_dict(ctx.cfg), ctx.plan.to_dict())
    progress = Progress(t.steps, start, enabled=ctx.is_logging_rank, mode=t.progress)
    if start:
        progress.message(f"resumed from step {start} ({latest[1].name})")
    p = ctx.plan
    ranks, stages = p.pipeline.ranks, p.num_stages
    msg = (
        f"training {tr.params:,} parameters on {ranks} rank{'s' * (ranks != 1)} x {ctx.device.type}, "
        f"{stages} stage{'s' * (stages != 1)}, schedule {ctx.plan.pipeline.schedule}, "
        f"{ctx.plan.pipeline.microbatches} microbatch{'es' * (ctx.plan.pipeline.microbatches != 1)}"
    )
    progress.message(msg)
    records.log(msg)
    history = []
    step = start
    guard = NonFiniteGuard(t.on_nonfinite)

    def say(line: str) -> None:
        progress.message(line)
        records.log(line)

    stopped = False
    try:
        for step in range(start, t.steps):
            m = tr.step(step)
            done = step + 1
            eval_due = done == t.steps or (t.eval_every and done % t.eval_every == 0)
            if eval_due:
                m.update(tr.evaluate(step))
            record = {"step": done, "time": time.time(), **m}
            records.metrics(record)
            tracker.log(m, step=done)
            history.append(record)
            show = done % t.log_every == 0 or done == t.steps or eval_due
            progress.update(done, m, print_line=show)
            guard.after_step(done, m, say)  # train.on_nonfinite: stop (raises) before anything is saved, or skip
            if show:
                records.log(
                    " ".join(
                        f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in record.items()
                        if k
                        in (
                            "step",
                            "loss",
                            "indexer_loss",
                            "lr",
                            "tokens_per_s",
                            "acc",
                            "eval_loss",
                            "eval_acc",
                            "eval_bpb",
                        )
                    )
                )
            if t.ckpt_every and done % t.ckpt_every == 0 and done != t.steps:
                save_checkpoint(
                    checkpoint_dir(ctx.run_dir, done), tr.modules, tr.opt, ctx.rank, done, ctx.group, t.keep_checkpoints
                )
            if t.stop_at_step is not None and done == t.stop_at_step and done != t.steps:
                stopped = True
                progress.message(f"stopping after step {done} (train.stop_at_step); resume with train.resume=true")
                break
        if not stopped and t.final_ckpt:
            save_checkpoint(
                checkpoint_dir(ctx.run_dir, t.steps),
                tr.modules,
                tr.opt,
                ctx.rank,
                t.steps,
                ctx.group,
                t.keep_checkpoints,
            )
    finally:
        progress.close()
        tracker.finish()
        records.close()
    return history
