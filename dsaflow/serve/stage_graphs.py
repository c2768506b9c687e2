"""The graph blocks a serving rank registers: for each stage it owns, each group and each decode / prefill / mixed
block of the plan, the static inputs and the callable that the GraphManager captures (dsaflow/serve/graph_manager.py).

Decode blocks: class = rows, one token each; the last stage's decode graphs sample as well, so their output is the
[rows, 2] message (tokens, EOS flags) with the fp32 logits. Prefill blocks: class = tokens per chunk at the group's
full rows (and, with continuous batching, over the group's top rows), one block per attention path label
(dsaflow/model/dense_prefill.py). Mixed blocks: class = tokens of a token-major mixed pass [1, T] (serve.max_pass_
tokens), each token's cache row from the static `token_rows` buffer, so one graph serves any split of its tokens into
decode rows and prompt chunks. A stage that opens on S reads the previous stage's indices from the group's static
index buffer (`_received`).
"""

from __future__ import annotations

from typing import Optional

import torch

from dsaflow.model import dense_prefill

from .graph_manager import StaticInput


class GraphBlocks:
    """Graph-block registration of `PipelineEngine` (a mixin: it reads the engine's stages, caches, plan, graph
    manager and sampling settings)."""

    def _graph_name(self, block_name: str, group: int) -> str:
        return block_name if self.groups == 1 else f"{block_name}/g{group}"

    def _stage_input(self, stage: int, rows: int, tokens: int) -> StaticInput:
        if stage == self.first:
            return StaticInput((rows, tokens), torch.long, 0)
        return StaticInput((rows, tokens, self.model_cfg.dim), self.dtype, 0)

    def _register(self, stage: int, block, group: int) -> None:
        module, cache = self.stages[stage], self.group_caches[stage][group]
        top, name = max(block.shape_classes), self._graph_name(block.name, group)
        top_k = self.model_cfg.index_topk
        if block.kind == "decode":  # class = batch rows, one token each
            inputs = {"x": self._stage_input(stage, top, 1), "positions": StaticInput((top, 1), torch.long, -1)}
            samples = stage == self.last  # the graph samples as well: -> (message [rows, 2], fp32 logits [rows, V])
            if samples and self.keyed:
                inputs["keys"] = StaticInput((top,), torch.long, 0)

            def fn(v):
                out = module(v["x"], v["positions"], cache, indices_in=self._received(stage, cache, v["positions"]))
                return self._sample(out[:, 0], v.get("keys")) if samples else out

            self.graphs.register(name, "decode", stage, block.shape_classes, 0, fn, inputs)
        elif block.kind == "mixed":
            self._register_mixed(stage, module, cache, name, block.shape_classes)
        else:  # prefill: class = tokens per chunk, rows fixed at the group's rows; one block per graph label
            for path in dense_prefill.graph_labels(self.prefill_paths, top_k, cache.max_context + 1):
                classes = dense_prefill.graph_classes(path, block.shape_classes, top_k, **self.prefill_rule)
                if not classes:
                    continue
                path_name = self._path_name(name, path)
                self._register_prefill(stage, module, cache, path_name, path, classes)
                for c in self.row_classes[:-1]:  # the top c rows of the group (the last class is the whole group)
                    top_rows = cache.rows(cache.max_batch - c, cache.max_batch)
                    self._register_prefill(stage, module, top_rows, f"{path_name}/r{c}", path, classes)

    def _register_prefill(self, stage: int, module, cache, name: str, path: str, classes) -> None:
        """A prefill graph block of one attention path: each class replays the path's static hint
        (`dense_prefill.graph_hint`), so a captured graph never depends on the positions of the pass."""
        rows, top = cache.max_batch, max(classes)
        topk, cache_rows = self.model_cfg.index_topk, cache.max_context + 1
        inputs = {"x": self._stage_input(stage, rows, top), "positions": StaticInput((rows, top), torch.long, -1)}
        fn = lambda v: module(  # noqa: E731
            v["x"].contiguous(),
            v["positions"].contiguous(),
            cache,
            indices_in=self._received(stage, cache, v["positions"]),
            prefill=dense_prefill.graph_hint(path, v["x"].shape[1], topk, cache_rows, self.prefill_rule["max_keys"]),
        )
        self.graphs.register(name, "prefill", stage, classes, 1, fn, inputs)

    def _register_mixed(self, stage: int, module, cache, name: str, classes) -> None:
        """A mixed graph block: class c = a token-major pass x [1, c] (stage 0: token ids; else [1, c, dim]), its
        positions and token_rows [1, c] in static buffers that the engine fills before each replay (padding: position
        -1, row 0; dsaflow.serve.mixed.pad_mixed_pass). The last stage returns logits [1, c, V]: the engine samples the
        emitting columns outside the graph, as in an eager mixed pass."""
        top = max(classes)
        inputs = {
            "x": self._stage_input(stage, 1, top),
            "positions": StaticInput((1, top), torch.long, -1),
            "token_rows": StaticInput((1, top), torch.long, 0),
        }

        def fn(v):
            positions = v["positions"].contiguous()
            received = self._received(stage, cache, positions)
            return module(v["x"].contiguous(), positions, cache, indices_in=received, token_rows=v["token_rows"])

        self.graphs.register(name, "mixed", stage, classes, 1, fn, inputs)

    @staticmethod
    def _path_name(name: str, path: str) -> str:
        """The graph block of a prefill graph label: the configured name for sparse, else `<name>+<label>`."""
        return name if path == "sparse" else f"{name}+{path}"

    def _received(self, stage: int, cache, positions: torch.Tensor) -> Optional[torch.Tensor]:
        """Cross-stage indices for a stage that opens on S: the [R, T] view of the cache's static index buffer, into
        which `_stage` copied what the previous stage sent (static memory, so a captured graph reads each pass's
        copy); None for every other stage."""
        if not self.plan.receives_indices(stage):
            return None
        R, T = positions.shape
        return cache.index[:R, :T]

    def _block_name(self, stage: int, kind: str, group: int, path: str = "sparse") -> Optional[str]:
        for b in self.blocks.get(stage, ()):
            if b.kind == kind:
                return self._path_name(self._graph_name(b.name, group), path)
        return None
