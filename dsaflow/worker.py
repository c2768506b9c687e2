"""`python -m dsaflow.worker RUN_DIR [--job train|generate]`: the entry torchrun starts on every rank.

    torchrun --nproc-per-node 2 -m dsaflow.worker runs/20260101-120000-tiny-retrieval

A user error found in a worker (a bad or corrupt checkpoint, a data file the parent could not fully check, a serving
request) ends it with status 2 and one paragraph, written to `<RUN_DIR>/error-rank<r>.txt` (the `dsaflow` parent
prints it once) and to stderr, never a traceback. The worker dies with its parent (torchrun).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ERROR_FILE = "error-rank{rank}.txt"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dsaflow.worker", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a run dir written by `dsaflow train` (config.yaml + plan.json)")
    ap.add_argument("--job", default="train", choices=("train", "generate"))
    args = ap.parse_args(argv)
    from dsaflow.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, PlanError
    from dsaflow.launch.lifecycle import die_with_parent

    die_with_parent()
    rank = os.environ.get("RANK", "0")
    try:
        from dsaflow.launch.worker import run_worker

        run_worker(args.run_dir, args.job)
    except PlanError as exc:
        msg = str(exc)
        try:
            from dsaflow.files import atomic_write

            atomic_write(Path(args.run_dir) / ERROR_FILE.format(rank=rank), msg + "\n")  # never through a link
        except OSError:
            pass
        if not os.environ.get("DSAFLOW_PARENT"):  # run by hand: no parent to print it
            print(f"dsaflow {args.job}: error: [rank {rank}] {msg}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    except Exception as exc:  # noqa: BLE001 - a lost peer is reported in one line; anything else is a bug
        if not _lost_peer(exc):
            raise
        print(f"dsaflow {args.job}: rank {rank} lost a peer ({str(exc).splitlines()[0][-160:]}); stopping",
              file=sys.stderr, flush=True)
        sys.exit(1)


def _lost_peer(exc: BaseException) -> bool:
    """A collective or p2p failed because another rank died (gloo/NCCL report it as a RuntimeError)."""
    text = str(exc)
    return any(s in text for s in ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                                   "Socket Timeout", "NCCL communicator was aborted", "remote process exited",
                                   "Timed out waiting", "timed out after", "Timeout waiting", "Application timeout"))


if __name__ == "__main__":
    main(sys.argv[1:])
