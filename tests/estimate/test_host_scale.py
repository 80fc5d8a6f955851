"""The local host's speed scales the clock's host terms and nothing else (``memopt.host_speed``): a host that
issues ops 1.5x slower makes a host-bound step 1.5x longer and leaves a GPU-bound step's GPU time alone; the probe
that measures it keeps the user's random streams; a bad scale is refused by name."""

from dataclasses import replace

import pytest
import torch
from torch import nn

import memopt
from memopt.estimate.timing import HOST_CONSTANTS, host_time, step_time, timing_for
from memopt.hardware import load_hardware
from memopt.host_speed import REFERENCE_OP_S, host_scale, probe_op_seconds, scale_for
from memopt.strategy import Strategy


def _scaled(name: str, scale: float):
    hw = load_hardware(name)
    return replace(hw, extra={**hw.extra, "host_scale": scale})


def test_the_scale_multiplies_every_host_constant_and_no_gpu_constant():
    base, slow = timing_for(load_hardware("h200")), timing_for(_scaled("h200", 1.5))
    for name in HOST_CONSTANTS:
        assert getattr(slow, name) == pytest.approx(1.5 * getattr(base, name))
    for name in ("matmul_efficiency", "attention_efficiency", "memory_efficiency", "launch_s", "overlap_loss",
                 "offload_efficiency", "recurrent_step_s", "alloc_retry_s"):
        assert getattr(slow, name) == getattr(base, name)


def test_the_scale_composes_with_a_kinds_own_constants():
    own = timing_for(load_hardware("h100_80gb"))
    scaled = timing_for(_scaled("h100_80gb", 2.0))
    assert scaled.memory_efficiency == own.memory_efficiency  # the H100's own, kept
    assert scaled.dispatch_s == pytest.approx(2.0 * own.dispatch_s)


def test_a_host_bound_step_grows_with_the_scale_and_a_gpu_bound_one_does_not():
    zero = {"matmul": 0.0, "attention": 0.0, "memory": 0.0, "launches": 0.0}
    host_bound = {"forward": {**zero, "launches": 10_000.0}, "backward": dict(zero), "optimizer": dict(zero),
                  "micro_batches": 1}
    gpu_bound = {"forward": {**zero, "memory": 1.0, "launches": 10.0}, "backward": dict(zero),
                 "optimizer": dict(zero), "micro_batches": 1}
    base, slow = timing_for(load_hardware("h200")), timing_for(_scaled("h200", 1.5))
    assert host_time(host_bound["forward"], slow) == pytest.approx(1.5 * host_time(host_bound["forward"], base))
    # 10,000 ops x 25.8 us = 0.258 s of host against 0.084 s of GPU launches: the host sets the step
    assert step_time(host_bound, slow)[0] / step_time(host_bound, base)[0] == pytest.approx(1.5, rel=0.1)
    assert step_time(gpu_bound, slow)[1]["forward_s"] == step_time(gpu_bound, base)[1]["forward_s"]
    assert step_time(gpu_bound, slow)[0] == pytest.approx(step_time(gpu_bound, base)[0], rel=0.01)


@pytest.mark.parametrize("bad", ["fast", 0, -1.0, float("inf")])
def test_a_bad_scale_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"extra\.host_scale must be a positive number"):
        timing_for(_scaled("h200", bad))


def test_the_estimate_of_a_slower_host_is_slower_by_its_host_part():
    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x).relu()
            return x.square().mean()

    prof = memopt.profile(Mlp(), torch.randn(4, 8, 32), hardware="h200", use_cache=False)
    s = Strategy(precision="bf16_autocast", micro_batch_size=4)
    base = memopt.estimate(prof, s, hardware=load_hardware("h200"), exact_reserved=False)
    slow = memopt.estimate(prof, s, hardware=_scaled("h200", 2.0), exact_reserved=False)
    assert base.detail["host_bound"] == 1.0  # a tiny model: the host sets its step
    assert slow.detail["host_s"] == pytest.approx(2.0 * base.detail["host_s"])
    assert slow.step_time_s > 1.8 * base.step_time_s


def test_scales_come_in_steps_and_within_bounds():
    assert scale_for(REFERENCE_OP_S) == 1.0
    assert scale_for(1.02 * REFERENCE_OP_S) == 1.0  # within half a step: the same spec, the same memoized estimates
    assert scale_for(1.5 * REFERENCE_OP_S) == pytest.approx(1.5, rel=0.025)
    assert scale_for(100 * REFERENCE_OP_S) == 4.0
    assert scale_for(REFERENCE_OP_S / 100) == 0.25


def test_no_gpu_or_the_probe_not_asked_for_means_the_fitted_host(monkeypatch):
    host_scale.cache_clear()
    monkeypatch.delenv("MEMOPT_HOST_PROBE", raising=False)
    assert host_scale() == 1.0  # off by default: the probe did not track the host cost of real rows
    host_scale.cache_clear()
    monkeypatch.setenv("MEMOPT_HOST_PROBE", "1")
    if not torch.cuda.is_available():
        assert host_scale() == 1.0
    host_scale.cache_clear()


def test_the_probe_keeps_the_random_streams_and_measures_something():
    state = torch.get_rng_state()
    op_s = probe_op_seconds("cpu", iters=1, repeats=1)
    assert torch.equal(state, torch.get_rng_state())
    assert 0 < op_s < 0.01  # seconds per op: microseconds on any host, not a whole step


def test_a_config_sets_the_scale_by_hand_and_a_bad_one_fails_validation():
    from memopt.config.compose import compose_plan_config
    from memopt.config.validate import validate

    good = compose_plan_config(["model=gpt2", "budget=8GiB", "hardware=h200", "+hardware.extra.host_scale=1.3"])
    assert validate(good) == []
    bad = compose_plan_config(["model=gpt2", "budget=8GiB", "hardware=h200", "+hardware.extra.host_scale=-1"])
    assert len(validate(bad)) == 1 and "extra.host_scale must be a positive number" in validate(bad)[0]
