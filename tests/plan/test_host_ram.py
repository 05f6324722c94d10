"""The host RAM of a run with the NVMe tiers follows the largest layers, the pools and the
devices (rp_engine/plan/host_ram.py), not the number of layers; without them it is the state."""

from __future__ import annotations

from rp_engine.host.defaults import PARAM_BUFFERS
from rp_engine.plan.host_ram import (
    MIN_OPTIMIZER_SLICE,
    RUNTIME_BYTES,
    RUNTIME_GROWTH,
    HostRam,
    PoolCounts,
    fit_pools,
    size_classes,
    tier_host_ram,
)

LAYER, HEAD = 2_000_000, 20_000_000  # parameters of a decoder layer, of an untied LM head


def _ram(layers: int, *, tiers: bool, grad_buffers: int = 8) -> HostRam:
    return tier_host_ram(
        layer_params=[HEAD] + [LAYER] * layers + [HEAD],
        layer_trainable=[HEAD] + [LAYER] * layers + [HEAD],
        dtype_bytes=2, devices=2, optimizer_tier=tiers, param_tier=tiers,
        grad_buffers=grad_buffers if tiers else 0,
    )  # fmt: skip


def test_with_both_tiers_ram_does_not_grow_with_depth() -> None:
    shallow, deep = _ram(20, tiers=True), _ram(80, tiers=True)
    assert shallow.training == deep.training
    # only the model the user built (2 B per parameter), until initialize paged it
    assert deep.model - shallow.model == 60 * LAYER * 2


def test_without_tiers_ram_is_the_state() -> None:
    shallow, deep = _ram(20, tiers=False), _ram(80, tiers=False)
    # bf16 weights twice (double-buffered), masters + moments 12 B, gradients 4 B
    grew = deep.training - shallow.training
    assert grew == 60 * LAYER * (2 * 2 + 12 + 4)


def test_the_pools_are_sized_by_ordinary_layers_and_the_big_few() -> None:
    sizes = size_classes([12 * HEAD] + [12 * LAYER] * 10 + [12 * HEAD])
    assert sizes.ordinary == -(-12 * LAYER // 4096) * 4096
    assert sizes.big == -(-12 * HEAD // 4096) * 4096 and sizes.big_count == 2
    assert sizes.pool_bytes(4) == 4 * sizes.ordinary + 2 * sizes.big
    uniform = size_classes([4096 * k for k in (3, 3, 4, 5)])  # none above twice the median
    assert uniform.big == 0 and uniform.ordinary == 5 * 4096
    ram = dict(_ram(20, tiers=True).parts)
    assert ram["gradient tier buffers"] == size_classes(
        [4 * HEAD] + [4 * LAYER] * 20 + [4 * HEAD]
    ).pool_bytes(8)
    assert ram["runtime (Python, torch, DeepSpeed)"] == RUNTIME_BYTES + RUNTIME_GROWTH


def _need(counts: PoolCounts) -> HostRam:
    return tier_host_ram(
        layer_params=[HEAD] + [LAYER] * 20 + [HEAD],
        layer_trainable=[HEAD] + [LAYER] * 20 + [HEAD],
        dtype_bytes=2, devices=2, optimizer_tier=True, param_tier=True,
        grad_buffers=counts.grad, optimizer_buffers=counts.optimizer, param_buffers=counts.param,
        optimizer_slice=counts.optimizer_slice,
    )  # fmt: skip


WANTED, FEWEST = PoolCounts(6, 8, 5), PoolCounts.fewest(2, grad_tier=True, slicing=False)


def test_pools_that_fit_are_kept() -> None:
    counts, need = fit_pools(_need(WANTED).peak, WANTED, FEWEST, _need)
    assert counts == WANTED and need == _need(WANTED)


def test_pools_shrink_largest_buffer_first_to_fit_and_stop_at_the_fewest() -> None:
    """An optimizer buffer (12 B per parameter of a layer) gives back three gradient buffers'
    worth (4 B): the optimizer pool shrinks first; no budget takes any pool below its
    fewest."""
    assert FEWEST == PoolCounts(2, 4, 2)  # whole layers (slicing: the next test)
    one_less = _need(PoolCounts(5, 8, 5)).peak
    counts, need = fit_pools(one_less, WANTED, FEWEST, _need)
    assert counts == PoolCounts(5, 8, 5) and need.peak <= one_less
    budget = (_need(WANTED).peak + _need(FEWEST).peak) // 2
    counts, need = fit_pools(budget, WANTED, FEWEST, _need)
    assert need.peak <= budget and FEWEST.optimizer <= counts.optimizer < WANTED.optimizer
    counts, need = fit_pools(1, WANTED, FEWEST, _need)  # nothing fits: the least is returned
    assert counts == FEWEST and need == _need(FEWEST)


def test_slicing_the_optimizer_state_fits_budgets_whole_layers_cannot() -> None:
    """Issue 49: below what the fewest whole-layer buffers need, the optimizer tier's records
    are sliced (halved from the largest record, down to MIN_OPTIMIZER_SLICE): its pool then
    holds a few slices whatever the layers' width, and the least a run can work with drops."""
    sliced = PoolCounts.fewest(2, grad_tier=True)
    assert sliced == PoolCounts(2, 4, 2, MIN_OPTIMIZER_SLICE)
    whole = _need(FEWEST)
    least = _need(sliced)
    assert dict(least.parts)["optimizer tier buffers"] == 2 * MIN_OPTIMIZER_SLICE
    assert least.peak < whole.peak
    budget = (whole.peak + least.peak) // 2
    counts, need = fit_pools(budget, WANTED, sliced, _need, largest_record=12 * HEAD)
    assert need.peak <= budget and MIN_OPTIMIZER_SLICE <= counts.optimizer_slice < 12 * HEAD
    counts, need = fit_pools(1, WANTED, sliced, _need, largest_record=12 * HEAD)
    assert counts == sliced and need == least
    # the gradients: records of whole tensors, a layer's here (one tensor), never less
    tensors = tier_host_ram(
        layer_params=[LAYER] * 4, layer_trainable=[LAYER] * 4, dtype_bytes=2, devices=2,
        optimizer_tier=True, param_tier=True, grad_buffers=4, optimizer_slice=MIN_OPTIMIZER_SLICE,
        layer_tensors=[[LAYER]] * 4,
    )  # fmt: skip
    assert dict(tensors.parts)["gradient tier buffers"] == 4 * 4 * (-(-LAYER // 1024) * 1024)
    # without a record size to halve, or with slicing not allowed, nothing is sliced
    counts, _ = fit_pools(budget, WANTED, sliced, _need)
    assert counts.optimizer_slice == 0


def test_frozen_weights_served_from_files_are_page_cache_not_ram() -> None:
    """A LoRA base mapped from its folder: the frozen weights are neither the model initialize
    holds, nor compute weights in RAM, nor records of the parameter tier (its pool is sized by
    the adapters'); they are listed apart, not counted."""
    adapters = 10_000  # trainable per layer
    layers = [HEAD] + [LAYER] * 20 + [HEAD]
    files = [HEAD] + [LAYER - adapters] * 20 + [HEAD]
    trainable = [0] + [adapters] * 20 + [0]

    def ram(param_tier: bool, layer_files: list[int]) -> HostRam:
        return tier_host_ram(
            layer_params=layers, layer_trainable=trainable, dtype_bytes=2, devices=2,
            optimizer_tier=False, param_tier=param_tier, grad_buffers=0,
            layer_files=layer_files,
        )  # fmt: skip

    plain, mapped = ram(True, []), ram(True, files)
    assert plain.model == sum(layers) * 2 and plain.file_pages == 0
    assert mapped.model == 20 * adapters * 2
    assert mapped.file_pages == sum(files) * 2
    assert any("not counted: frozen weights read from their files" in x for x in mapped.lines())
    pool = dict(mapped.parts)["parameter tier buffers"]
    assert pool == size_classes([2 * adapters] * 20).pool_bytes(PARAM_BUFFERS)
    assert pool < dict(plain.parts)["parameter tier buffers"]
    no_tier = dict(ram(False, files).parts)
    assert no_tier["compute weights"] == 20 * adapters * 2 * 2  # double-buffered adapters
