"""Serving: the `dsaflow generate` job (`generate.py`), the pipeline engine (chunked prefill + decode across stages),
the per-device CUDA graph manager and its capture report, sampling, point-to-point transfers, and weight loading."""
