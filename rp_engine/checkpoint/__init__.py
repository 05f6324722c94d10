"""Checkpoints in DeepSpeed's ZeRO layout.

Owns ``save`` / ``load`` (``engine.save_checkpoint`` / ``load_checkpoint``) and ``save_16bit``
(``save_16bit_model``); the training data loader (DeepSpeed's ``deepspeed_io`` and
``RepeatingLoader``) is rp_engine/data.py. One job per module:

- ``layout.py``: DeepSpeed's file names and key names, parameters by root name.
- ``writer.py``: ``save`` (flat fp32 partitions, ZeRO-3 placeholders, loss scaler) and
  ``save_16bit``.
- ``reader.py``: ``load`` (unflattening, placeholders, optimizer state, counters).
- ``commit.py``: atomic folder commits and crash recovery.
- ``checks.py``: files checked before anything is loaded (complete, fitting the model).
- ``safe_load.py``: ``weights_only`` loading with DeepSpeed's classes allowed, nothing else.

The layout is what users' tools glob for::

    save_dir/
      latest                                        text: the tag (default global_step{N})
      zero_to_fp32.py, zero_to_torch.py             copied from the installed DeepSpeed
      <tag>/
        mp_rank_00_model_states.pt                  ZeRO stage 0-2
        zero_pp_rank_0_mp_rank_00_model_states.pt   ZeRO stage 3
        [bf16_]zero_pp_rank_0_mp_rank_00_optim_states.pt

so ``deepspeed.utils.zero_to_fp32``, Hugging Face's resume (``global_step*``) and DeepSpeed's own
``engine.load_checkpoint`` (ZeRO 1-3 and fp32 stage 0, with optimizer states; tests/
test_checkpoint_interop.py)
work unchanged. The files are what DeepSpeed's engine of the configured stage writes at data-
parallel world size 1 (recorded as ``dp_world_size``):

- ``*_optim_states.pt``: the fp32 masters as DeepSpeed's flat partitions (ZeRO-1/2: one per param
  group, ``single_partition_of_fp32_groups`` with ``group_paddings`` / ``param_alignment_
  paddings``; ZeRO-3: one per sub-group of ``sub_group_size``, ``fp32_flat_groups``), the inner
  optimizer's state_dict with one flat parameter per partition (Adam's moments flattened alike,
  ``step`` per partition), DeepSpeed's loss-scaler object and, for rp_engine, its own full
  scaler state (``rp_loss_scaler``).
- ZeRO-3's ``module`` holds 0-element placeholders for the parameters, as DeepSpeed's (its loader
  copies the state_dict into partitioned parameters of shape [0]); weights come back from the
  optim file (also for ``load_module_only``) or ``frozen_param_fragments``. Stage 0-2 ``module``
  holds the full compute-dtype state_dict.
- Stage 0 fp32: the optimizer's per-parameter state_dict is in the model file's ``optimizer``
  (where DeepSpeed's stage-0 engine reads it); the optim file still holds the fp32 masters
  (zero_to_fp32 reads them) but no optimizer state (not twice). Otherwise ``optimizer`` is None.

Choices where DeepSpeed's own output would be less useful:

- The fp32 masters always go to a ``*_optim_states.pt`` file, also at stage 0 (DeepSpeed writes
  none there, and zero_to_fp32 cannot read such a checkpoint). Stage 0 with fp16/bf16 keeps the
  ZeRO-1 layout (DeepSpeed's FP16_Optimizer / BF16_Optimizer layouts are not written).
- Frozen parameters are recorded (``frozen_param_shapes`` / ``frozen_param_fragments``) at every
  stage, not only from stage 2, so zero_to_fp32 returns them too (in the compute dtype).
- ``param_slice_mappings`` (for DeepSpeed's universal-checkpoint converter) is not written.
- Files load with ``torch.load(weights_only=True)`` plus the DeepSpeed classes allowed by
  safe_load.py (the optim file pickles DeepSpeed's ``LossScaler`` / ``DynamicLossScaler``, which
  DeepSpeed's optimizers use as they find them). Loading never runs code from a file; anything
  beyond the allowlist needs the caller's opt-in.

Writes are atomic: files go to ``save_dir/.<tag>.tmp-<pid>``, are fsynced, and the folder is
renamed to ``<tag>``; ``latest`` is replaced last. A crash leaves the previous checkpoint and
``latest`` (commit.py).
"""

from __future__ import annotations

from rp_engine.checkpoint.layout import model_file_name, optim_file_name
from rp_engine.checkpoint.reader import load
from rp_engine.checkpoint.writer import save, save_16bit

__all__ = ["save", "load", "save_16bit", "model_file_name", "optim_file_name"]
