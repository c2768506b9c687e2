"""A closed stdout does not stop a run: `dsaflow train ... | head -3` trains to the end.

When the reader of stdout goes away, the next write fails with EPIPE (Python ignores SIGPIPE). A worker that let
that error escape would die, and its peers would report a lost peer. `survive_closed_stdout()` wraps sys.stdout so
that the first EPIPE points the descriptor at /dev/null and the run goes on: what it has to say is still in
train.log and metrics.jsonl.
"""

from __future__ import annotations

import os
import sys


class ClosedPipeSafe:
    """A text stream proxy whose write/flush never raise BrokenPipeError (later output goes to /dev/null)."""

    def __init__(self, stream):
        self._stream = stream
        self.closed_pipe = False

    def _to_devnull(self) -> None:
        self.closed_pipe = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()
            try:
                self._stream.flush()  # the buffered rest goes to /dev/null
            except OSError:
                pass

    def __getattr__(self, name):
        return getattr(self._stream, name)


def survive_closed_stdout() -> None:
    """Wrap sys.stdout (once) so that a closed pipe never ends the process."""
    if not isinstance(sys.stdout, ClosedPipeSafe) and sys.stdout is not None:
        sys.stdout = ClosedPipeSafe(sys.stdout)
