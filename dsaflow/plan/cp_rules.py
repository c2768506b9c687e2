"""What parallel.cp (context parallelism) runs, checked before anything launches: each rule refuses by name, with
the fix, what the cp runtime (dsaflow.model.context_parallel) does not do."""

from __future__ import annotations

from dsaflow.errors import PlanError
from dsaflow.plan.plan import PipelinePlan
from dsaflow.plan.schedule import SPLIT_BACKWARD_SCHEDULES


def check_context_parallel(cfg, pipeline: PipelinePlan) -> None:
    """Refuse a parallel.cp > 1 config the runtime cannot run (PlanError naming the field, the value, the fix)."""
    cp = pipeline.cp
    if cp == 1:
        return
    t = cfg.train
    where = f"parallel.cp={cp}"
    if cfg.mode != "train":
        raise PlanError(f"{where} splits training sequences; mode={cfg.mode} does not train. Fix: parallel.cp=1.")
    if t.seq_len % (2 * cp):
        fit = 2 * cp * max(1, t.seq_len // (2 * cp))
        raise PlanError(
            f"train.seq_len={t.seq_len} does not split into 2 x {where} = {2 * cp} equal chunks (each cp rank holds "
            f"two of them, zigzag). Fix: train.seq_len={fit}, or a parallel.cp whose double divides it."
        )
    if pipeline.schedule in SPLIT_BACKWARD_SCHEDULES:
        raise PlanError(
            f"pipeline.schedule={pipeline.schedule} splits each backward into an input and a weight pass; under "
            f"{where} the keys' gradient is reduce-scattered inside the backward, which that split would run twice. "
            "Fix: pipeline.schedule=Interleaved1F1B, 1F1B or GPipe."
        )
    if cfg.pipeline.cross_stage_indices:
        raise PlanError(
            f"pipeline.cross_stage_indices=true with {where}: sending indices across stages is not run with context "
            "parallelism. Fix: pipeline.cross_stage_indices=false (stages that open on S promote that layer)."
        )
    if str(t.recompute) == "attention":
        raise PlanError(
            f"train.recompute=attention with {where} would gather every layer's keys again for each of its "
            "recomputed attention chunks in the backward (train.seq_len / parallel.cp / train.recompute_chunk_tokens "
            "gathers per layer instead of one). Fix: train.recompute=block (or none)."
        )
    moe = cfg.model.moe
    if moe is not None and moe.aux_loss_weight > 0:
        raise PlanError(
            f"model.moe.aux_loss_weight={moe.aux_loss_weight} with {where}: the sequence-wise balance loss needs each "
            "sequence's routing statistics whole, and a cp rank sees only its shard. Fix: model.moe.aux_loss_weight=0 "
            "(the bias update balances the experts without it), or parallel.cp=1."
        )
    mtp = cfg.model.mtp_layers
    if mtp > 0 and t.mtp_loss_weight > 0:
        raise PlanError(
            f"model.mtp_layers={mtp} with train.mtp_loss_weight={t.mtp_loss_weight} and {where}: MTP depth k reads and "
            "predicts the tokens k places after each position, which at the end of every zigzag chunk lie on another "
            "cp rank, so a rank's shard cannot compute the MTP loss. Fix: train.mtp_loss_weight=0 (the MTP layers are "
            "then carried through untrained, as loaded), or parallel.cp=1."
        )
    if str(t.dsa_stage) == "dense_warmup" or t.dense_warmup_steps > 0:
        raise PlanError(
            f"train.dsa_stage={t.dsa_stage} / train.dense_warmup_steps={t.dense_warmup_steps} with {where}: the dense "
            "warm-up attends per head over whole sequences, which context parallelism does not split. Fix: run the "
            "warm-up without cp, then train.init_from=that run with parallel.cp."
        )
