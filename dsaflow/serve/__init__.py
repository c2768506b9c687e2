"""Serving: the `dsaflow generate` job (`generate.py`), the pipeline engine (chunked prefill + decode across stages),
the per-device CUDA graph manager with the graphs each stage registers (`graph_manager.py`), the capture report, and
sampling (stages, p2p and the pipeline schedule: dsaflow.pipeline; weights: dsaflow.checkpoint)."""
