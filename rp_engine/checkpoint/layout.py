"""DeepSpeed's names in a checkpoint: the file names, the key names of the files' contents, and
parameters by root name with their tied aliases. The writer and the reader both spell them from
here, so a checkpoint reads back what was written."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["has_optimizer_state", "model_file_name", "optim_file_name"]

# DeepSpeed's key names (deepspeed/checkpoint/constants.py), spelled out so that importing this
# module does not import DeepSpeed.
_OPTIMIZER_STATE_DICT = "optimizer_state_dict"
_BASE_OPTIMIZER_STATE = "base_optimizer_state"
_SINGLE_PARTITION = "single_partition_of_fp32_groups"
_FP32_FLAT_GROUPS = "fp32_flat_groups"
_ZERO_STAGE = "zero_stage"
_PARTITION_COUNT = "partition_count"
_GROUP_PADDINGS = "group_paddings"
_PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"
_LOSS_SCALER = "loss_scaler"
_CLIP_GRAD = "clip_grad"
# Not DeepSpeed's: rp_engine's full loss-scaler state, next to DeepSpeed's scaler object.
_RP_LOSS_SCALER = "rp_loss_scaler"
# Not DeepSpeed's: the delay compensation's scale per parameter name ("lookahead_dc"), so a
# resumed run compensates as the run that saved (optim/delay_compensation.py).
_RP_DELAY_COMPENSATION = "rp_delay_compensation"
# Not DeepSpeed's: the data-parallel world that trained and its shard layout (layer owners).
# DeepSpeed's own ``dp_world_size`` keeps its meaning for its loaders: the number of optimizer
# partition files, always 1 here (rank 0 writes the whole state, which loads at any world size).
_RP_DATA_PARALLEL = "rp_data_parallel"

# Top-level keys of the model-states file that belong to DeepSpeed (never client state).
_OWN_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "frozen_param_fragments",
        "shared_params",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "checkpoint_parallel_dimensions",
        _RP_DATA_PARALLEL,
    }
)


# --- file names --------------------------------------------------------------------------------
def model_file_name(zero_stage: int) -> str:
    """DeepSpeed's model-states file name (stage 3 names it like a ZeRO partition)."""
    if zero_stage >= 3:
        return "zero_pp_rank_0_mp_rank_00_model_states.pt"
    return "mp_rank_00_model_states.pt"


def optim_file_name(*, bf16: bool) -> str:
    """DeepSpeed's optimizer-states file name (``bf16_`` prefix when bf16 is enabled)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_0_mp_rank_00_optim_states.pt"


class _ParamNames:
    """Root names of a module's parameters by identity, and tied aliases (DeepSpeed's
    ``shared_params``: alias name -> name of the first occurrence, which holds the data)."""

    def __init__(self, module: nn.Module) -> None:
        self.primary: dict[int, str] = {}
        self.shared: dict[str, str] = {}
        self.params: list[tuple[str, nn.Parameter]] = []
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in self.primary:
                self.shared[name] = self.primary[id(p)]
            else:
                self.primary[id(p)] = name
                self.params.append((name, p))

    def of(self, param: torch.Tensor) -> str:
        try:
            return self.primary[id(param)]
        except KeyError:
            raise ValueError(
                f"an optimized parameter of shape {tuple(param.shape)} is not a parameter of "
                "engine.module; it cannot be named in the checkpoint"
            ) from None


def has_optimizer_state(engine: Any) -> bool:
    """Whether ``engine``'s checkpoints hold optimizer state (masters, moments, loss scaler):
    not a forward-only engine's (``initialize`` without an optimizer, optim/build.py's
    ``NoOptimizer``), whose files, as DeepSpeed's, hold the module and counters only."""
    host = engine.host_optimizer
    return host is not None and not host.empty
