"""Progress display on the logging rank: a rich bar on a terminal, plain lines every `log_every` steps otherwise
(CI logs, files), nothing on other ranks."""

from __future__ import annotations

import sys
from typing import Mapping


def _fmt(metrics: Mapping[str, float], keys) -> str:
    parts = []
    for k in keys:
        if k in metrics:
            v = metrics[k]
            parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)


SHOWN = ("loss", "indexer_loss", "lr", "tokens_per_s", "mfu", "acc", "eval_acc", "eval_loss", "eval_bpb")
BAR = ("loss", "acc", "tokens_per_s")  # the live bar: short enough for a 100-column terminal
EVAL = ("eval_loss", "eval_acc", "eval_bpb")


class Progress:
    """`update(step, metrics)` after every step; `close()` at the end. mode: auto | rich | lines | off."""

    def __init__(
        self,
        total: int,
        start: int = 0,
        enabled: bool = True,
        mode: str = "auto",
        stream=None,
        label: str = "train",
        unit: str = "step",
    ):
        self.stream, self.label, self.unit = stream or sys.stdout, label, unit
        self.total, self._bar, self._task = total, None, None
        if not enabled or mode == "off":
            self.mode = "off"
        elif mode == "rich" or (mode == "auto" and self.stream.isatty()):
            self.mode = "rich"
        else:
            self.mode = "lines"
        if self.mode == "rich":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn(f"[bold]{label}"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                transient=False,
                console=Console(file=self.stream),
            )
            self._bar.start()
            self._task = self._bar.add_task(label, total=total, completed=start, info="")

    def update(self, step: int, metrics: Mapping[str, float], print_line: bool) -> None:
        """step: steps completed so far (1-based)."""
        if self.mode == "rich":
            if any(k in metrics for k in EVAL):  # eval results stay on screen, one line each: the history is visible
                self._bar.console.print(f"step {step}/{self.total} {_fmt(metrics, ('loss',) + EVAL)}")
            self._bar.update(self._task, completed=step, info=_fmt(metrics, BAR))
        elif self.mode == "lines" and print_line:
            print(f"{self.unit} {step}/{self.total} {_fmt(metrics, SHOWN)}", file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if self.mode == "rich":
            self._bar.console.print(text)
        elif self.mode == "lines":
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
