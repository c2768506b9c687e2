"""Training one pipeline rank: the Trainer and its loop (`trainer.run_train`; `Trainer.step` is the step on one
screen), the pipelining plumbing, optimisers and clipping, and step metrics (checkpoints: dsaflow.checkpoint)."""
