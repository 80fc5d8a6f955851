"""``set_expandable_segments``: set before CUDA starts; after, a mode already in force is accepted silently and a
different one is refused with a warning (the allocator's segment mode cannot change once it holds memory)."""

import warnings

import pytest
import torch

from memopt.step import hard_cap as budget


@pytest.fixture
def cuda_holding_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 1 << 30)


@pytest.mark.parametrize("conf, enabled, accepted", [
    ("expandable_segments:True", True, True),
    ("max_split_size_mb:128,expandable_segments:False", False, True),
    ("", False, True),  # the default mode is in force
    ("", True, False),
    ("expandable_segments:False", True, False),
    ("expandable_segments:True", False, False),
])
def test_a_mode_in_force_since_cuda_started_is_accepted_and_another_refused(monkeypatch, cuda_holding_memory, conf,
                                                                            enabled, accepted):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert budget.set_expandable_segments(enabled) is accepted
    assert bool(caught) is not accepted
    if caught:
        assert "can no longer change" in str(caught[0].message)


def test_before_cuda_starts_the_mode_goes_into_the_environment(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:False")
    assert budget.set_expandable_segments(True)
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:True"
