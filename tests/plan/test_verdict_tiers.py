"""The dry run's verdict says every tier: a plan that needs host RAM (or NVMe) shows it beside FITS, against the
RAM it was checked with -- this machine's unless the user names one (shipped hardware files name none)."""

from __future__ import annotations

from io import StringIO

import pytest
from rich.console import Console

from memopt.cli_render import render_plan
from memopt.distributed.host_tier import machine_host_memory_bytes
from memopt.hardware import hardware_names, load_hardware
from memopt.plan.planner import make_plan
from memopt.units import GiB, format_bytes

SAMPLE = {"batch_size": 8, "seq_len": 64}


def _verdict(plan) -> str:
    out = StringIO()
    render_plan(plan, console=Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    return text[text.index(" FITS "):text.index("Chosen techniques")]


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    import memopt

    return memopt.profile("tiny_llama", sample=SAMPLE, hardware="h200")


def test_shipped_hardware_leaves_host_ram_to_the_machine():
    assert all(load_hardware(n).host_memory_bytes == 0 for n in hardware_names())


def test_an_offload_plan_shows_host_ram_beside_fits(profile):
    plan = make_plan("tiny_llama", SAMPLE, budget="8GiB", hardware="h200", world_size=2, pins={"offload": True},
                     profile=profile)
    assert plan.fits and plan.prediction["host_bytes_per_node"] > 0
    verdict = _verdict(plan)
    host = format_bytes(plan.prediction["host_bytes_per_node"])
    assert f"host RAM: {host} per node of {format_bytes(machine_host_memory_bytes())} (this machine's RAM)" in verdict
    named = make_plan("tiny_llama", SAMPLE, budget="8GiB", hardware="h200", world_size=2, pins={"offload": True},
                      profile=profile, host_memory="64GiB")
    assert f"of {format_bytes(64 * GiB)} (host_memory)" in _verdict(named)
    too_small = make_plan("tiny_llama", SAMPLE, budget="8GiB", hardware="h200", world_size=2, profile=profile,
                          host_memory=1 << 20, pins={"offload": True})
    assert not too_small.fits and "host RAM" in (too_small.infeasible or {}).get("message", "")


def test_a_plan_without_offload_shows_the_gpu_alone(profile):
    plan = make_plan("tiny_llama", SAMPLE, budget="8GiB", hardware="h200", profile=profile)
    verdict = _verdict(plan)
    assert "GPU:" in verdict and "host RAM" not in verdict
