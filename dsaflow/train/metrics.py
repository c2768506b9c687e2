"""Throughput and MFU estimates, and the run's own records (metrics.jsonl + train.log) on the logging rank.

MFU = achieved model FLOP/s / peak FLOP/s of the ranks. Model FLOPs per trained token (`model_flops_per_token`) are
6 * N (N = parameters outside the embedding table, which is a lookup) plus the sparse attention of every layer and
the indexer scores and indexer loss of every F layer (dsaflow.plan.estimates.train_flops_per_token): for DSA these
are a large part of the work, so leaving them out would understate MFU at long context. Peak per rank:
`train.peak_tflops` if set, else dense bf16 tensor-core peaks for known GPUs (H100/H200 SXM: 989 TFLOP/s,
A100: 312), else a nominal 0.1 TFLOP/s for a CPU process (a laptop-class figure; CPU MFU is indicative only).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Mapping, Optional

import torch

from dsaflow.files import append_text, atomic_write, open_append
from dsaflow.rundir.folder import LOG, METRICS, read_metrics

from .nonfinite import json_record

GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
CPU_NOMINAL_TFLOPS = 0.1


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
