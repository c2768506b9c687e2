"""`python -m dsaflow.launch.agent [torchrun args]`: torchrun, run in-process under dsaflow's process rules.

The same arguments as `python -m torch.distributed.run`. Differences: the agent dies with the `dsaflow` parent
(dsaflow.launch.lifecycle), its logging stays quiet, and a worker failure ends it with the worker's exit status and
one line instead of torchrun's traceback: status 2 means a worker found a user error and wrote it to
`<run_dir>/error-rank<r>.txt` (the parent prints it). A multi-node launch (launch/multi_node.sh) says at once which
rendezvous it waits for and for how long (`--rdzv-conf join_timeout=...`, from launch.timeout_s), and a rendezvous
that times out or cannot be reached ends it with one line naming the endpoint, the nodes it expected and the fix.
"""

from __future__ import annotations

import logging
import sys

from dsaflow.errors import EXIT_USER_ERROR


def main(argv=None) -> int:
    from .lifecycle import die_with_parent

    die_with_parent()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # After the imports: torch sets its loggers' levels when it creates them. torch.distributed.run's only
    # warnings are banners (the OMP_NUM_THREADS default; each worker sets its own thread count).
    for name in ("torch.distributed.elastic", "torch.distributed.run"):
        logging.getLogger(name).setLevel(logging.CRITICAL)

    from torch.distributed.elastic.rendezvous.api import RendezvousError

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    where = _rendezvous_line(args)
    if where:
        print(f"dsaflow: {where}", file=sys.stderr, flush=True)
    try:
        run(args)
    except RendezvousError as exc:
        first = " ".join(str(exc).split())[:200]
        what = type(exc).__name__ + (f": {first}" if first else "")
        print(
            f"dsaflow: the rendezvous failed ({what}) while {where or 'waiting'}. Fix: start every node with the "
            "same RUN_DIR, NNODES, MASTER_ADDR and MASTER_PORT (node 0 first), check that MASTER_ADDR:MASTER_PORT "
            "is reachable from every node, or raise launch.timeout_s.",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except ChildFailedError as exc:
        if any(f.exitcode == EXIT_USER_ERROR for f in exc.failures.values()):
            return EXIT_USER_ERROR
        rank, first = exc.get_first_failure()
        code = first.exitcode
        how = f"signal {-code}" if code < 0 else f"status {code}"
        print(
            f"dsaflow: worker rank {rank} ended with {how}; torchrun stopped the other ranks",
            file=sys.stderr,
            flush=True,
        )
        return 1 if code < 0 else code
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return 130
    return 0


def _rendezvous_line(args) -> str:
    """'waiting for ...' for a multi-node rendezvous; '' for a single node (--standalone)."""
    if getattr(args, "standalone", False) or str(args.nnodes) in ("1", "1:1"):
        return ""
    conf = dict(kv.split("=", 1) for kv in (args.rdzv_conf or "").split(",") if "=" in kv)
    return (
        f"waiting for {args.nnodes} nodes at the rendezvous {args.rdzv_endpoint} (this is node "
        f"{args.node_rank}; giving up after {conf.get('join_timeout', '600')} s)"
    )


if __name__ == "__main__":
    from .lifecycle import exit_now

    exit_now(main())
