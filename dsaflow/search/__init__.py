"""The IndexCache layer search: which layers keep their indexer (training-free, greedy, pipeline-aware)."""

from .evaluate import PatternEvaluator, Score
from .greedy import SearchLog, Step, greedy_search

__all__ = ["PatternEvaluator", "Score", "SearchLog", "Step", "greedy_search"]
