"""Training one pipeline rank: the loop (`loop.run_train`), the Trainer (stages, schedule, optimisers, data), the
pipelining plumbing, optimisers and clipping, and step metrics (checkpoints: dsaflow.checkpoint)."""
