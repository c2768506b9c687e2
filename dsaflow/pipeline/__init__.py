"""What training and serving share at run time: a worker's view of itself (`run_context.py`: config, plan, rank,
device, process group; `devices.py`), stage cutting (`stages.py`), point-to-point links between stages (`p2p.py`),
the one pipelined forward executor (`executor.py`) with its tick timeline (`timeline.py`) and CUDA graphs of its
transfers (`transfer_graphs.py`), and the guard every CUDA-graph capture runs under (`capture_guard.py`)."""
