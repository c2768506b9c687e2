"""A training step's metrics, throughput and MFU estimates, and the run's records (metrics.jsonl + train.log).

MFU = achieved model FLOP/s / peak FLOP/s of the ranks. Model FLOPs per trained token (`model_flops_per_token`) are
6 * N (N = parameters outside the embedding table, which is a lookup) plus the sparse attention of every layer and
the indexer scores and indexer loss of every F layer (dsaflow.plan.estimates.train_flops_per_token): for DSA these
are a large part of the work, so leaving them out would understate MFU at long context. Peak per rank:
`train.peak_tflops` if set, else dense bf16 tensor-core peaks for known GPUs (H100/H200 SXM: 989 TFLOP/s,
A100: 312), else a nominal 0.1 TFLOP/s for a CPU process (a laptop-class figure; CPU MFU is indicative only).

`StepMetrics` turns one training step into its metrics: per-step values that live on other ranks (stage compute
time, indexer loss, peak memory, non-finite losses, expert load) reach the logging rank through one small all-reduce.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from dsaflow.config.moe_schema import is_moe_layer
from dsaflow.files import append_text, atomic_write, open_append
from dsaflow.model.mtp import mtp_runs_in_training
from dsaflow.rundir.folder import LOG, METRICS, read_metrics

from .nonfinite import json_record, nonfinite_flag

GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
CPU_NOMINAL_TFLOPS = 0.1
# the metrics of a step that train.log shows (every metric goes to metrics.jsonl and the tracker)
LOGGED_KEYS = ("step", "loss", "indexer_loss", "lr", "tokens_per_s", "acc", "eval_loss", "eval_acc", "eval_bpb")


def peak_tflops_per_rank(train_cfg, device: torch.device) -> Optional[float]:
    if train_cfg.peak_tflops:
        return float(train_cfg.peak_tflops)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, v in GPU_PEAK_TFLOPS.items():
            if key in name:
                return v
        return None
    return CPU_NOMINAL_TFLOPS


def model_flops_per_token(model_cfg, plan, seq_len: int, model_params: int, embedding_params: int) -> float:
    """Training FLOPs per token of the whole model (every stage), from the plan's roles and sources."""
    from dsaflow.plan.estimates import train_flops_per_token

    served = {}
    for layer in plan.layers:
        served[layer.source] = served.get(layer.source, 0) + 1
    roles = [(l.role, served.get(l.index, 1)) for l in plan.layers]
    return train_flops_per_token(model_cfg, roles, seq_len, model_params - embedding_params)


def count_parameters(modules: Sequence[torch.nn.Module], device: torch.device, group=None) -> tuple[int, int]:
    """(parameters, of which embedding) of the whole model: this rank's stage modules summed over every rank."""
    n = torch.zeros(2, dtype=torch.float64, device=device)
    for m in modules:
        n[0] += sum(p.numel() for p in m.parameters())
        if m.embed is not None:
            n[1] += m.embed.weight.numel()
    dist.all_reduce(n, group=group)
    return int(n[0]), int(n[1])


class StepMetrics:
    """The metrics of one training step on one rank (complete on the logging rank).

    ctx: the RunContext; stages: (stage index, ChunkTimer, indexer-loss list) per local stage, the lists the stages
    append their detached per-microbatch indexer losses to; loss_fn: the LMLoss (its accuracy counters); balance:
    the ExpertBalance (dsaflow/train/expert_balance.py), which writes the step's expert load into `expert_load`."""

    def __init__(
        self, ctx, stages: Sequence[tuple], loss_fn, balance, tokens_per_step: int, params: int, embedding_params: int
    ):
        self.ctx, self.stages, self.loss_fn, self.tokens_per_step = ctx, list(stages), loss_fn, tokens_per_step
        self.balance = balance
        m = ctx.cfg.model
        self.moe_layer_ids = [i for i in range(m.num_layers + m.mtp_layers) if is_moe_layer(m, i)]
        self.mtp = mtp_runs_in_training(ctx.cfg)  # the step's vector carries the MTP loss (`mtp_loss`)
        t, plan = ctx.cfg.train, ctx.plan
        self.has_last = any(plan.is_last(index) for index, _, _ in self.stages)
        self.has_answers = loss_fn.num_queries > 0
        peak = peak_tflops_per_rank(t, ctx.device)
        self.peak_flops = None if peak is None else peak * 1e12 * plan.pipeline.world_size
        self.flops_per_token = model_flops_per_token(ctx.cfg.model, plan, t.seq_len, params, embedding_params)
        self.start()

    def start(self) -> None:
        """Before a step: its clock starts; timers, indexer losses, accuracy counters and the vector the step
        all-reduces start from zero: [busy per stage | indexer loss per stage | memory per rank | non-finite flag |
        expert load | MTP loss (model.mtp_layers > 0) | LM loss, correct answers, answers (parallel.dp > 1: the last
        stage of every replica)]."""
        self.t0 = time.perf_counter()
        S, R = self.ctx.plan.num_stages, self.ctx.plan.pipeline.ranks
        self.mtp_slot = 2 * S + R + 1 + self.balance.width()
        width = self.mtp_slot + int(self.mtp) + (3 if self.ctx.replicas > 1 else 0)
        self.vec = torch.zeros(width, dtype=torch.float64, device=self.ctx.device)
        # the ExpertBalance writes here after the optimizer step
        self.expert_load = self.vec[2 * S + R + 1 : 2 * S + R + 1 + self.balance.width()]
        for _, timer, indexer_losses in self.stages:
            timer.reset()
            indexer_losses.clear()
        self.loss_fn.reset()

    def finish(self, update: Dict[str, float], losses: List[torch.Tensor]) -> Dict[str, float]:
        """After a step: `update` (lr, gradient norms, skips) followed by time, throughput, pipeline efficiency,
        whether any stage's loss was not finite (`nonfinite_losses`, dsaflow/train/nonfinite.py), per-stage time
        and indexer loss, peak memory per rank (CUDA), expert load per MoE layer (a step that routed tokens), MFU,
        and on the last stage's rank the LM loss (mean of the per-microbatch `losses`) and retrieval accuracy."""
        ctx = self.ctx
        S, R = ctx.plan.num_stages, ctx.plan.pipeline.ranks
        vec, nonfinite_slot = self.vec, 2 * S + R
        if ctx.is_cuda:  # peak device memory of this rank since the run started (weights, optimiser, activations)
            vec[2 * S + ctx.rank % R] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
        for index, timer, indexer_losses in self.stages:
            vec[index] = timer.seconds()
            if indexer_losses:
                vec[S + index] = torch.stack(indexer_losses).mean().double()
        stage_losses = [*losses, *(x for _, _, indexer_losses in self.stages for x in indexer_losses)]
        vec[nonfinite_slot] = nonfinite_flag(stage_losses, vec.device)
        # with MTP layers the totals hold their loss too: the LM and MTP parts are the loss function's last
        # len(losses) calls (torch's shape inference at the first step calls it once more, before them)
        lm_losses = self.loss_fn.lm_losses[-len(losses) :] if self.loss_fn.lm_losses else losses
        if self.mtp and self.has_last:  # one last stage per replica writes its microbatch mean
            vec[self.mtp_slot] = torch.stack(self.loss_fn.mtp_losses[-len(losses) :]).float().mean().double()
        dp = ctx.replicas  # dp x cp: a cp rank's loss is scaled so that the mean over cp is the sequences' loss
        if dp > 1 and self.has_last:  # the replica's loss and answer counts, reduced with the rest over the world
            vec[-3] = torch.stack([l.detach().float() for l in lm_losses]).mean().double()
            vec[-2], vec[-1] = torch.as_tensor(self.loss_fn.correct), torch.as_tensor(self.loss_fn.total)
        # dp > 1: over every replica too; per-stage and per-rank entries then hold dp times a replica's value (the
        # expert load is the same on every replica: reduced over dp before the bias update)
        dist.all_reduce(vec, group=ctx.group if dp == 1 else None)
        if dp > 1:
            vec[:nonfinite_slot].div_(dp)
            self.expert_load.div_(dp)
            vec[self.mtp_slot : self.mtp_slot + int(self.mtp)].div_(dp)
        if ctx.is_cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        busy = vec[:S].tolist()
        m: Dict[str, float] = {
            **update,
            "step_time_s": wall,
            "tokens_per_s": self.tokens_per_step / wall,
            "indexer_loss": float(vec[S : 2 * S].sum()),
            "pipeline_efficiency": sum(busy) / (R * wall),
            "nonfinite_losses": float(vec[nonfinite_slot]),  # > 0: a stage's loss was NaN/inf (train.on_nonfinite)
        }
        for s in range(S):
            m[f"stage{s}_time_s"] = busy[s]
            m[f"stage{s}_indexer_loss"] = float(vec[S + s])
        if ctx.is_cuda:
            for r in range(R):
                m[f"rank{r}_peak_mem_gib"] = float(vec[2 * S + r])
        m.update(self.balance.metrics(self.expert_load, self.moe_layer_ids))
        if self.peak_flops:
            m["mfu"] = self.flops_per_token * m["tokens_per_s"] / self.peak_flops
        if self.mtp:
            m["mtp_loss"] = float(vec[self.mtp_slot])
        if dp > 1 and self.has_last:  # the mean over replicas of equal shares: the global batch's mean
            m["loss"] = float(vec[-3] / dp)
            if self.has_answers:
                m["acc"] = float(vec[-2] / vec[-1]) if vec[-1] > 0 else float("nan")
        elif self.has_last:
            m["loss"] = float(torch.stack([l.detach().float() for l in lm_losses]).mean())
            if self.has_answers:
                m["acc"] = self.loss_fn.accuracy()
        return m


class RunRecords:
    """The run's records: metrics.jsonl (one JSON object per logged step) and train.log, a `logging` file handler
    on the logger "dsaflow.train.rank<r>" of the logging rank. Other ranks hold a disabled instance; their logger has
    no file handler, so library code may log freely on every rank. `close()` detaches the handler."""

    def __init__(self, run_dir: Path, enabled: bool, rank: int = 0):
        self.enabled = enabled
        self.metrics_path, self.log_path = Path(run_dir) / METRICS, Path(run_dir) / LOG
        self.logger = logging.getLogger(f"dsaflow.train.rank{rank}")
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False  # the console shows the progress output; train.log gets these lines
        for old in list(self.logger.handlers):  # a run that ended without close() in this process (tests run several)
            self.logger.removeHandler(old)
            old.close()
        self.handler = None
        if enabled:  # never through a link planted in the run dir (dsaflow.files)
            self.handler = logging.StreamHandler(open_append(self.log_path))
            self.handler.setFormatter(logging.Formatter("%(message)s"))
            self.logger.addHandler(self.handler)

    def close(self) -> None:
        if self.handler is not None:
            self.logger.removeHandler(self.handler)
            self.handler.close()
            self.handler.stream.close()
            self.handler = None

    def truncate_after(self, step: int) -> None:
        """On resume: drop records of steps the interrupted run logged after its last checkpoint."""
        if not self.enabled:
            return
        keep = [r for r in read_metrics(self.metrics_path.parent) if r["step"] <= step]
        atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in keep))

    def metrics(self, record: Mapping) -> None:
        if self.enabled:
            append_text(self.metrics_path, json_record(record) + "\n")  # NaN/inf as null: valid JSON

    def log(self, line: str) -> None:
        if self.enabled:
            self.logger.info(line)

    def log_step(self, record: Mapping) -> None:
        """One train.log line of a step's record: its LOGGED_KEYS as key=value."""
        self.log(
            " ".join(
                f"{k}={v:.5g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items() if k in LOGGED_KEYS
            )
        )
