"""Serving: the `dsaflow generate` job (`generate.py`), the pipeline engine (chunked prefill + decode across stages),
the per-device CUDA graph manager (`graph_manager.py`), the graphs each stage registers (`stage_graphs.py`) and
the capture report, and sampling (stages, p2p and the executor:
dsaflow.pipeline; weights: dsaflow.checkpoint)."""
