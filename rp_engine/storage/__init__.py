"""The memory tiers below host RAM: NVMe files, the I/O engines that move them (DeepSpeed's aio
op or the built-in O_DIRECT threads), aligned staging buffers cached by a record pool
(record_pool.py), the optimizer tier that streams each layer's fp32 masters and Adam moments
through them (optimizer_tier.py), the gradient tier whose bounded pool holds the fp32 gradients
and spills them to a file when more are alive than it holds (grad_tier.py), and the parameter
tier that keeps the compute weights there, read ahead of their uploads (param_tier.py).

Facts and figures: ../shared/reference/nvme_tier.md. Nothing here knows about devices or plans;
the optimizer stepper, the host store and the executor call in (optim/stepper.py,
model/host_store.py, runtime/executor.py).
"""

from rp_engine.storage.aligned import ALIGN, aligned_empty, round_up
from rp_engine.storage.grad_tier import GradTier
from rp_engine.storage.io_engine import IOEngine, IOStats, make_io_engine
from rp_engine.storage.optimizer_tier import OptimizerTier
from rp_engine.storage.param_tier import ParamTier
from rp_engine.storage.swap_file import NvmeSpaceError, SwapFile, check_nvme_path

__all__ = [
    "ALIGN",
    "GradTier",
    "IOEngine",
    "IOStats",
    "NvmeSpaceError",
    "OptimizerTier",
    "ParamTier",
    "SwapFile",
    "aligned_empty",
    "check_nvme_path",
    "make_io_engine",
    "round_up",
]
