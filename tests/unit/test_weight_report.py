"""Weight comparisons of the test suite (tests/support/engine_helpers.py) say which tensor and
by how much, and keep torch's own report."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_close_named, assert_same_weights
from torch import nn


def test_a_weight_mismatch_names_the_tensor_and_the_largest_difference() -> None:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    b = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    b.load_state_dict(a.state_dict())
    assert_same_weights(a, b)
    with torch.no_grad():
        b[1].weight[1, 2] += 0.25
    with pytest.raises(AssertionError) as err:
        assert_same_weights(a, b)
    text = str(err.value)
    assert text.startswith("parameter '1.weight': largest |difference| 0.25")
    assert "Greatest absolute difference" in text and "index (1, 2)" in text  # torch's report


def test_a_shape_mismatch_names_the_tensor() -> None:
    a, b = nn.Linear(3, 4), nn.Linear(3, 4)
    b.weight = nn.Parameter(torch.zeros(4, 2))
    with pytest.raises(AssertionError, match=r"(?s)^parameter 'weight'\n.*shape"):
        assert_same_weights(a, b)


def test_any_named_comparison_keeps_torch_s_report() -> None:
    with pytest.raises(AssertionError) as err:
        assert_close_named(
            torch.zeros(3), torch.tensor([0.0, 0.0, 1e-3]), "lr at 2", rtol=0, atol=0
        )
    assert str(err.value).startswith("lr at 2: largest |difference| 0.001\n")
    assert "Mismatched elements: 1 / 3" in str(err.value)
