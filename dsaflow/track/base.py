"""The tracker interface and its null object. Core code calls these methods unconditionally; there are no
`if wandb:` branches anywhere: a rank that does not log, or a run with `track=none`, holds a NullTracker."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Mapping


class Tracker(ABC):
    """What the training loop may ask of an experiment tracker."""

    @abstractmethod
    def log_config(self, cfg_dict: Mapping[str, Any], plan_dict: Mapping[str, Any]) -> None: ...

    @abstractmethod
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    @abstractmethod
    def finish(self) -> None: ...


class NullTracker(Tracker):
    """Accepts everything, records nothing."""

    def log_config(self, cfg_dict: Mapping[str, Any], plan_dict: Mapping[str, Any]) -> None:
        pass

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def finish(self) -> None:
        pass
