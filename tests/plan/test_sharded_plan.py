"""The planner beyond one GPU (``memopt.plan.sharded``): engines, tiers of the budget, bad input.

Small models on the CPU; every figure comes from the sharded estimate the GPU rows check
(``tests/distributed/test_reserved_pools.py``)."""

from __future__ import annotations

import pytest

from memopt.hardware import load_hardware
from memopt.plan.context import resolve_policy
from memopt.plan.planner import make_plan
from memopt.plan.sharded import plan_sharded, sharding_settings
from memopt.techniques.sharding import ShardingSetting
from memopt.units import GiB, MiB

SAMPLE = {"batch_size": 8, "seq_len": 64}


@pytest.fixture(scope="module")
def profile():
    import memopt

    return memopt.profile("tiny_llama", sample=SAMPLE, hardware="h200")


def test_settings_cover_the_engines() -> None:
    two = [s.label() for s in sharding_settings(2, 1)]
    assert "ddp x2" in two and "fsdp2 x2" in two and {"zero1 x2", "zero2 x2", "zero3 x2"} <= set(two)
    assert any("offload(opt=cpu,params=cpu)" in label for label in two)
    assert not any("nvme" in label for label in two)  # NVMe only with a path
    one = list(sharding_settings(1, 1, nvme_path="/tmp"))
    assert all(s.offloads for s in one)  # one GPU without offload is the single-GPU search's
    assert any(s.offload_params == "nvme" for s in one)
    hybrid = [s for s in sharding_settings(16, 2) if s.replicate_size > 1]
    assert [(s.shard_size, s.replicate_size) for s in hybrid] == [(8, 2)]


def test_the_registry_sharding_entry_offers_the_settings_the_policy_allows() -> None:
    """The sharded planner's settings come from the registry entry: ``sharding_settings`` in its order, without
    offload where the policy forbids it; the entry names the precision and optimizer every setting runs."""
    from memopt.plan.policy import Policy
    from memopt.techniques.registry import BY_NAME

    entry = BY_NAME["sharding"]
    every = list(sharding_settings(4, 2, nvme_path="/tmp"))
    assert entry.options(4, 2, Policy.build(), nvme_path="/tmp") == every
    assert entry.options(4, 2, Policy.build(forbid={"offload": [True]})) == [s for s in every if not s.offloads]
    assert (entry.precision, entry.optimizer) == ("bf16_autocast", "adamw_fused")


def test_the_checkpointing_entry_coarse_grid_is_all_three_quarters_half_and_a_quarter() -> None:
    from memopt.techniques.registry import BY_NAME

    coarse = BY_NAME["checkpointing"].coarse
    assert [c.label() for c in coarse(10)] == ["none", "full", "full[7]", "full[5]", "full[2]"]
    assert [c.label() for c in coarse(3)] == ["none", "full", "full[2]", "full[1]"]
    assert [c.label() for c in coarse(0)] == ["none"]
    assert [c.label() for c in coarse(8, (1.0, 0.5))] == ["none", "full", "full[4]"]


def test_chosen_plan_is_the_fastest_fitting_candidate(profile) -> None:
    hw = load_hardware("h200")
    plan, cands = plan_sharded(profile, hw, 8 * GiB, resolve_policy(None), world_size=2, nodes=1,
                               host_memory_bytes=64 * GiB)
    fitting = [c for c in cands if c.fits]
    assert plan.fits and fitting
    assert plan.step_time_s == min(c.step_time_s for c in fitting)  # brute force over what was evaluated
    assert plan.strategy.extra("sharding")["world_size"] == 2
    assert plan.strategy.global_batch * 2 == SAMPLE["batch_size"]  # per-rank micro-batches keep the global batch
    for c in fitting:  # every tier checked: GPU total with the margin, host RAM
        assert c.total_bytes + plan.margin_bytes <= 8 * GiB
        assert c.prediction.host_bytes_per_node <= 0.9 * 64 * GiB
    d = plan.to_dict()
    assert d["total_bytes"] == d["peak_reserved_bytes"] + d["runtime_bytes"]
    assert d["peak_reserved_bytes"] >= d["peak_allocated_bytes"]


def test_tighter_budget_is_never_faster(profile) -> None:
    hw = load_hardware("h200")
    pol = resolve_policy(None)
    times = []
    for budget in (8 * GiB, 2 * GiB, 1200 * MiB):
        plan, _ = plan_sharded(profile, hw, budget, pol, world_size=2, nodes=1, host_memory_bytes=64 * GiB)
        if plan.fits:
            times.append(plan.step_time_s)
    assert times == sorted(times) and len(times) >= 2


def test_host_ram_is_a_tier(profile) -> None:
    """Offload that fits the GPU but not host RAM is not a plan, and the message says so and what would."""
    hw = load_hardware("h200")
    offload_only = [ShardingSetting(engine="fsdp2", stage=3, world_size=1, offload_optimizer="cpu",
                                    offload_params="cpu")]
    ok, _ = plan_sharded(profile, hw, 8 * GiB, resolve_policy(None), world_size=1, nodes=1,
                         host_memory_bytes=64 * GiB, settings=offload_only)
    assert ok.fits and ok.prediction["host_bytes_per_node"] > 0
    tiny_host = ok.prediction["host_bytes_per_node"]  # 90% of it is too little
    bad, cands = plan_sharded(profile, hw, 8 * GiB, resolve_policy(None), world_size=1, nodes=1,
                              host_memory_bytes=tiny_host, settings=offload_only)
    assert not bad.fits and all("host RAM" in c.reason for c in cands)
    assert "host RAM" in bad.infeasible["message"] and "What would" in bad.infeasible["message"]


def test_make_plan_world_size_and_bad_input(profile, tmp_path) -> None:
    plan = make_plan("tiny_llama", SAMPLE, budget="8GiB", hardware="h200", world_size=2, host_memory="64GiB",
                     profile=profile)
    assert plan.fits and "x2" in plan.strategy.label()
    assert any(n.startswith("launch: torchrun --nproc-per-node 2 ") for n in plan.notes)
    with pytest.raises(ValueError, match="does not split over 3 GPUs"):
        make_plan("tiny_llama", SAMPLE, budget="8GiB", hardware="h200", world_size=3, profile=profile)
    with pytest.raises(ValueError, match=r"nvme_path .* is not a directory"):
        make_plan("tiny_llama", SAMPLE, budget="8GiB", hardware="h200", world_size=2, profile=profile,
                  nvme_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="bf16"):
        make_plan("tiny_llama", SAMPLE, budget="8GiB", hardware="h200", world_size=2, profile=profile,
                  fidelity="exact")


def test_saved_sharded_plan_round_trips(profile, tmp_path) -> None:
    from memopt.plan.schema import Plan

    plan = make_plan("tiny_llama", SAMPLE, budget="8GiB", hardware="h200", world_size=2, host_memory="64GiB",
                     profile=profile)
    back = Plan.load(plan.save(tmp_path / "plan.json"))
    assert back.strategy == plan.strategy and back.strategy.extra("sharding") == plan.strategy.extra("sharding")


def test_launch_note_names_the_launcher_and_the_export() -> None:
    from memopt.plan.sharded import launch_note

    multi = launch_note(ShardingSetting(engine="fsdp2", stage=3, world_size=16, nodes=2, replicate_size=2))
    assert "--nnodes 2 --nproc-per-node 8" in multi and "export_accelerate_config" in multi
    ds = launch_note(ShardingSetting(engine="deepspeed", stage=3, world_size=8, offload_optimizer="cpu"))
    assert "--nproc-per-node 8" in ds and "export_deepspeed_json" in ds


def test_wrap_refuses_a_plan_for_another_world_size(profile) -> None:
    """A plan for 2 GPUs applied in one plain process: the error says how to launch it (or to re-plan)."""
    import memopt
    from memopt.models import build_model

    plan = make_plan("tiny_llama", SAMPLE, budget="8GiB", hardware="h200", world_size=2, host_memory="64GiB",
                     profile=profile)
    with pytest.raises(ValueError, match=r"torchrun --nproc-per-node 2.*world_size=1"):
        memopt.wrap(build_model("tiny_llama"), plan=plan)


DEEP = {"num_hidden_layers": 10, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
        "num_key_value_heads": 8}


@pytest.fixture(scope="module")
def deep_profile():
    import memopt
    from memopt.models import with_overrides

    return memopt.profile(with_overrides("tiny_llama", DEEP), sample={"batch_size": 8, "seq_len": 1024},
                          hardware="h200", use_cache=False)


def _fsdp2_totals(prof, hw, mb: int) -> dict[int, int]:
    """Every checkpointed-block count's predicted total (FSDP2 on 2 GPUs), by brute force."""
    from memopt.plan import sharded as sh
    from memopt.profile.engine_facts import facts_of_profile
    from memopt.strategy import Checkpointing, Strategy

    setting = ShardingSetting(engine="fsdp2", world_size=2)
    shared = sh._SharedWork(prof, facts_of_profile(prof), hw)
    out = {}
    for k in range(11):
        ck = Checkpointing(mode="none") if k == 0 else Checkpointing(mode="full", num_blocks=None if k == 10 else k)
        s = Strategy(precision="bf16_autocast", checkpointing=ck, micro_batch_size=mb, grad_accum_steps=4 // mb,
                     optimizer="adamw_fused", extras=(("sharding", setting.to_dict()),))
        out[k] = sh._predict(shared, s, setting).total_bytes
    return out


def test_block_counts_between_the_coarse_quarters_are_searched(deep_profile) -> None:
    """10 blocks: the coarse grid checkpoints 10, 7, 5 or 2 of them; with a budget where the fewest that fit is 9
    (or 8), the plan checkpoints exactly that many (found by bisection, checked here by brute force)."""
    from memopt.plan.policy import Policy

    hw = load_hardware("h200")
    pol = Policy.build(margin="0%", pins={"micro_batch_size": 4})
    totals = _fsdp2_totals(deep_profile, hw, 4)
    assert all(totals[k] > totals[k + 1] for k in range(1, 10))  # memory falls as blocks are checkpointed
    for want in (9, 8):
        budget = (totals[want] + totals[want - 1]) // 2  # k = want fits, k = want - 1 does not
        plan, _ = plan_sharded(deep_profile, hw, budget, pol, world_size=2, nodes=1, host_memory_bytes=64 * GiB,
                               settings=[ShardingSetting(engine="fsdp2", world_size=2)])
        assert plan.fits and plan.strategy.checkpointing.num_blocks == want, plan.strategy.label()
        assert plan.total_bytes <= budget


def test_under_cap_keeps_reserved_at_the_cap_and_charges_the_retries() -> None:
    from memopt.distributed.estimate import ShardedEstimate
    from memopt.plan.sharded_cap import REMAP_BYTES_PER_S, RETRY_FIXED_S, under_cap

    pred = ShardedEstimate(peak_allocated_bytes=10 * GiB, peak_reserved_bytes=13 * GiB, runtime_bytes=1 * GiB,
                           peak_at="forward: x", model_states_bytes=6 * GiB, engine_buffers_bytes=1 * GiB,
                           activations_bytes=3 * GiB, host_bytes_per_node=0, nvme_bytes_per_node=0, world_size=2)
    assert pred.total_bytes == 14 * GiB and pred.to_dict()["breakdown"]["allocator_overhead"] == 3 * GiB
    capped = under_cap(pred, 12 * GiB, micro_batches=4)
    assert capped is not None and capped.peak_reserved_bytes == 11 * GiB and capped.total_bytes == 12 * GiB
    assert capped.capped is not None and capped.capped.retries_per_step == 4
    assert capped.capped.retry_s == pytest.approx(4 * (RETRY_FIXED_S + 3 * GiB / REMAP_BYTES_PER_S))
    d = capped.to_dict()
    assert d["breakdown"]["allocator_overhead"] == 1 * GiB and d["capped"]["uncapped_reserved_bytes"] == 13 * GiB
    assert list(d)[-1] == "capped" and "step_time_s" not in d  # as a plan records it: capped last, untimed
    assert list(capped.replace(step_time_s=1.0).to_dict())[-2:] == ["capped", "step_time_s"]
    assert under_cap(pred, 11 * GiB - 1, micro_batches=4) is None  # the allocated peak itself does not fit


def test_one_rank_engines_count_nccl_and_deepspeed_outside_the_allocator() -> None:
    """Measured on H200s: an FSDP2 process alone in its NCCL group holds 1316 MiB outside the allocator, a
    DeepSpeed one 1708 MiB; the runtime (context, cuBLAS) is 804 MB of it."""
    from memopt.distributed.memory import sharded_memory
    from memopt.distributed.model_states import state_bytes

    sb = state_bytes("deepspeed", "bf16_autocast")
    runtime = load_hardware("h200").runtime_overhead_bytes
    ds = sharded_memory(10**8, engine="deepspeed", stage=2, world_size=1, sb=sb, offload_optimizer="cpu")
    fsdp = sharded_memory(10**8, engine="fsdp2", stage=3, world_size=1, sb=state_bytes("fsdp2"),
                          offload_optimizer="cpu", offload_params="cpu")
    assert abs(runtime + fsdp.nccl - 1316 * MiB) < 8 * MiB
    assert abs(runtime + ds.nccl - 1708 * MiB) < 8 * MiB
    two = sharded_memory(10**8, engine="fsdp2", stage=3, world_size=2, sb=state_bytes("fsdp2"))
    assert abs(runtime + two.nccl - 1600 * MiB) < 8 * MiB


def test_a_sharded_plan_that_does_not_fit_has_a_step_time(tmp_path) -> None:
    """It raised KeyError: 'step_time_s' (Plan.step_time_s, to_dict, save; the CLI exited 2 'unexpected error'):
    the smallest candidate, which it is, was never timed. It carries that one's, as a one-GPU plan does."""
    import memopt

    plan = make_plan("tiny_gpt2", {"batch_size": 4, "seq_len": 32}, budget="1GB", hardware="h100_80gb", world_size=2)
    assert not plan.fits and plan.step_time_s > 0
    assert memopt.Plan.load(plan.save(tmp_path / "p.json")).to_dict() == plan.to_dict()
