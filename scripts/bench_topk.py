"""Indexer top-k benchmarks: the two selects side by side, the whole op and its parts at long context, and the
logits at decode steps.

    python scripts/bench_topk.py select --out bench_out/topk_select
    python scripts/bench_topk.py indexer --out bench_out --no-sweeps
    python scripts/bench_topk.py decode --out bench_out
    python scripts/bench_topk.py finish --out bench_out
"""

from __future__ import annotations

import sys

from bench_lib import family_main

SUBCOMMANDS = {"select": "topk_select", "indexer": "topk_indexer", "decode": "topk_decode", "finish": "topk_finish"}


def main(argv=None) -> int:
    return family_main("bench_topk.py", __doc__.split("\n\n")[0], SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
