"""A GPU kind's own clock constants (``extra.timing`` in its hardware config) replace the H200's where given, and
nowhere else: the estimator and the search's lower bounds read the same constants; a bad constant is refused with
its name."""

from dataclasses import replace

import pytest
import torch
from torch import nn

import memopt
from memopt.errors import InputError
from memopt.estimate.timing import DEFAULT_TIMING, step_time, timing_for
from memopt.hardware import load_hardware
from memopt.strategy import Strategy


def test_a_kind_without_its_own_constants_keeps_the_h200s():
    assert timing_for(load_hardware("h200")) is DEFAULT_TIMING
    assert timing_for(load_hardware("a100_80gb")) is DEFAULT_TIMING


def test_the_h100_overrides_only_its_memory_efficiency():
    tm = timing_for(load_hardware("h100_80gb"))
    assert tm.memory_efficiency == pytest.approx(1.20)
    assert replace(tm, memory_efficiency=DEFAULT_TIMING.memory_efficiency) == DEFAULT_TIMING


def test_the_memory_term_scales_by_the_kinds_efficiency():
    # one second of ideal HBM traffic forward and nothing else (no ops, so no host time): 1 / memory_efficiency
    zero = {"matmul": 0.0, "attention": 0.0, "memory": 0.0, "launches": 0.0}
    terms = {"forward": {**zero, "memory": 1.0}, "backward": dict(zero), "optimizer": dict(zero),
             "micro_batches": 1}
    for name in ("h100_80gb", "h200"):
        tm = timing_for(load_hardware(name))
        assert step_time(terms, tm)[0] == pytest.approx(1.0 / tm.memory_efficiency)


@pytest.mark.parametrize("bad, message", [({"memory_eficiency": 1.0}, "unknown timing constants"),
                                          ({"dispatch_s": "fast"}, "must be numbers"),
                                          ({"launch_s": -1.0}, "must be >= 0")])
def test_a_bad_constant_is_refused_by_name(bad, message):
    hw = load_hardware("h200")
    hw = replace(hw, extra={**hw.extra, "timing": bad})
    with pytest.raises(ValueError, match=message):
        timing_for(hw)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                    for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x.square().mean()


def test_the_estimate_uses_the_constants_of_the_gpu_it_plans_for():
    prof = memopt.profile(Mlp(), torch.randn(8, 32, 64), hardware="h100_80gb", use_cache=False)
    s = Strategy(precision="bf16_autocast", micro_batch_size=8)
    own = memopt.estimate(prof, s, exact_reserved=False)
    h200s = memopt.estimate(prof, s, exact_reserved=False, timing=DEFAULT_TIMING)
    terms = own.detail["time_terms"]
    assert own.step_time_s == pytest.approx(step_time(terms, timing_for(load_hardware("h100_80gb")))[0])
    assert h200s.step_time_s == pytest.approx(step_time(terms, DEFAULT_TIMING)[0])
    assert own.step_time_s < h200s.step_time_s  # a larger memory efficiency: the same bytes take less time


def test_a_bad_constant_is_reported_before_anything_is_traced():
    """Not as every candidate of the search failing to estimate: the argument checks name it."""
    hw = load_hardware("h200")
    bad = replace(hw, extra={**hw.extra, "timing": {"memory_eficiency": 1.0}})
    with pytest.raises(InputError, match=r"unknown timing constants.*memory_eficiency"):
        memopt.plan(Mlp(), torch.randn(8, 32, 64), budget="8GiB", hardware=bad)


def test_a_config_with_a_bad_constant_fails_validation_by_name():
    from memopt.config.compose import compose_plan_config
    from memopt.config.validate import validate

    cfg = compose_plan_config(["model=gpt2", "budget=8GiB", "hardware=h200", "+hardware.extra.timing={launch_s: -1}"])
    assert validate(cfg) == ["hardware 'h200': extra.timing values must be >= 0, got {'launch_s': -1.0}"]
