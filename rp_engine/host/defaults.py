"""The NVMe pools' default buffer counts, in one place: the config schema's defaults
(``offload_optimizer.buffer_count``, ``offload_param.buffer_count``), the host-RAM model's
(plan/host_ram.py), the preflight's fallbacks, the advisor's configs and the gradient tier's
(``roundpipe.grad_buffers`` null) all read them here. Standard library only.
"""

from __future__ import annotations

__all__ = ["OPTIMIZER_BUFFERS", "PARAM_BUFFERS", "default_grad_buffers"]

OPTIMIZER_BUFFERS = 4  # zero_optimization.offload_optimizer.buffer_count (DeepSpeed's default)
PARAM_BUFFERS = 5  # zero_optimization.offload_param.buffer_count (DeepSpeed's default)


def default_grad_buffers(num_devices: int) -> int:
    """The gradient tier's buffers when ``roundpipe.grad_buffers`` is null, with the NVMe
    optimizer tier: 2 per device plus 4 (storage/build.py's ``grad_buffer_count`` holds the
    minimum a pool needs to make progress)."""
    return 2 * num_devices + 4
