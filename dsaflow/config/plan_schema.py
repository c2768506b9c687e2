"""`plan.*`: what `dsaflow plan` sizes a deployment against, where the pre-launch check measures the real device."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import num

# torch.cuda.get_device_properties(0).total_memory of an H200 (141 GB of HBM3e): 143,771 MiB = 150,754,820,096 bytes
H200_MEMORY_GIB = 143_771 / 1024  # 140.40 GiB


@dataclass
class PlanConfig:
    """What `dsaflow plan` sizes a deployment against (the pre-launch check measures the real device instead)."""

    # one device's memory in GiB as torch reports it (total_memory / 2**30); default an H200's. The plan counts 90% of
    # it as usable (dsaflow.plan.serve_memory.USABLE_FRACTION), as the pre-launch check does
    device_memory_gib: float = num(
        H200_MEMORY_GIB,
        0,
        4096,
        lo_open=True,
        why="one device's memory in GiB: 140.4 for an H200, 79.6 for an H100 80GB",
    )
