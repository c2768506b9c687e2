"""The run dir, written by the parent before any process starts: `folder.py` (config.yaml, plan.json, metrics,
where checkpoints sit; create, check and read a run dir) and `lock.py` (one job at a time per run dir)."""
