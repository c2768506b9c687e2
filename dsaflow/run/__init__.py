"""What a run is, shared by training and serving: its directory (`rundir.py`: config.yaml, plan.json, metrics,
checkpoints) and a worker's view of itself (`context.py`: config, plan, rank, device, process group)."""
