"""Training benchmarks: a pipeline's schedules, one layer's time by kernel kind, one stage's memory, the trainer's
step.

    python scripts/bench_train.py pipeline --ranks 2 --steps 8 model=tiny train.seq_len=64     # CPU, gloo
    python scripts/bench_train.py layer --seq 4096,16384 --layers 4 --out bench_out            # one GPU
    python scripts/bench_train.py stage --seq 16384,32768 --recompute none,attention --out bench_out
    python scripts/bench_train.py step --device cpu --microbatches 4,1 model.num_layers=2
"""

from __future__ import annotations

import sys

from bench_lib import family_main

SUBCOMMANDS = {"pipeline": "train_pipeline", "layer": "train_layer", "stage": "train_stage", "step": "train_step"}


def main(argv=None) -> int:
    return family_main("bench_train.py", __doc__.split("\n\n")[0], SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
