"""Starting runs: the parent's pre-launch checks and torchrun (`launch.py`), and the worker entry that torchrun starts
on every rank (`worker.py`: read the run dir, join the process group, run the train or generate job)."""
