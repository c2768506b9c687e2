"""`python -m dsaflow.launch.timeouts RUN_DIR`: print the run's launch.timeout_s (for launch/multi_node.sh), or one
line naming what is wrong with the run dir and exit 2."""

from __future__ import annotations

import sys
from pathlib import Path

from dsaflow.errors import EXIT_USER_ERROR, PlanError


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m dsaflow.launch.timeouts RUN_DIR", file=sys.stderr)
        return EXIT_USER_ERROR
    from dsaflow.config.compose import load_config
    from dsaflow.rundir.folder import CONFIG

    try:
        print(load_config(Path(args[0]) / CONFIG).launch.timeout_s)
    except PlanError as exc:
        print(f"dsaflow: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
