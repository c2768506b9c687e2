"""Stop signals in the parent: SIGINT, SIGTERM and SIGHUP, in any mix, end a command with one line and the status
128 + the first signal (130, 143, 129), never a traceback, at any moment from start-up to the final summary.

The first signal raises `Interrupted` (a KeyboardInterrupt, so the places that already turn Ctrl-C into one line
handle SIGTERM and SIGHUP too) and every later one is ignored: a second Ctrl-C 10 ms after the first, or a SIGTERM
from a scheduler after a Ctrl-C, must not cut the stopping short (the process tree is still being stopped, the
summary still being written). Handlers are installed for the life of `dsaflow`'s main (`stop_signals_raise`);
the launcher and sweeps see `Interrupted` wherever it lands.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signum)
        self.signum = signum


def ignore_while_stopping(signum, frame) -> None:
    """Later stop signals. A Python no-op rather than SIG_IGN: a signal already pending when the handler changes
    would otherwise make Python print "Signal 15 ignored due to race condition" with a traceback header."""


def raise_interrupted(signum, frame) -> None:
    for s in STOP_SIGNALS:  # once: later signals while stopping are ignored
        signal.signal(s, ignore_while_stopping)
    raise Interrupted(signum)


def stopping() -> bool:
    """True once a stop signal was raised (the handlers now ignore further ones)."""
    return signal.getsignal(signal.SIGINT) is ignore_while_stopping


def signal_of(exc: BaseException) -> int:
    """The stop signal behind a KeyboardInterrupt (SIGINT for Python's own)."""
    return getattr(exc, "signum", signal.SIGINT)


def status_of(exc: BaseException) -> int:
    return 128 + signal_of(exc)


def name_of(exc: BaseException) -> str:
    return signal.Signals(signal_of(exc)).name


@contextmanager
def stop_signals_raise():
    """Stop signals raise `Interrupted` inside the block (main thread only; elsewhere a no-op). After an
    interruption they stay ignored: the process is about to say its one line and exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, raise_interrupted) for s in STOP_SIGNALS}
    interrupted = False
    try:
        yield
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if not interrupted:
            for s, h in old.items():
                signal.signal(s, h)
