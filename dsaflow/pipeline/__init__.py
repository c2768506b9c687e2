"""What training and serving share at run time: a worker's view of itself (`run_context.py`: config, plan, rank,
device, process group; `devices.py`), stage cutting (`stages.py`), point-to-point links between stages (`p2p.py`),
the pipeline schedule of forward passes with its tick timeline (`ticks.py`), CUDA graphs of a tick's
transfers (`transfer_graphs.py`), and the guard every CUDA-graph capture runs under (`capture_guard.py`)."""
