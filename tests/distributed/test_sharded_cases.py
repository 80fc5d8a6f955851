"""CPU checks of the sharding GPU validation: cases, configs, predictions (hand arithmetic), the script, the report."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from harness import sharded_cases as sc
from memopt.distributed.engine_buffers import DS_DEFAULT_MAX_LIVE
from memopt.distributed.engine_bytes import MEMOPT_BUCKET_ELEMENTS
from memopt.strategy import Checkpointing
from memopt.units import GiB

ROOT = Path(__file__).resolve().parents[2]


def _script() -> Any:
    path = ROOT / "scripts" / "validate_sharding_gpu.py"
    spec = importlib.util.spec_from_file_location("validate_sharding_gpu", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["validate_sharding_gpu"] = mod
    spec.loader.exec_module(mod)
    return mod


# -- cases -------------------------------------------------------------------------------------------------
def test_single_gpu_cases_cover_the_issue() -> None:
    cases = {c.id: c for c in sc.single_gpu_cases()}
    assert set(cases) == {"memopt_zero2_offload_opt", "memopt_zero3_offload_all", "memopt_fsdp2_offload",
                          "baseline_zero3_offload", "baseline_fsdp2_offload"}
    for c in cases.values():
        assert c.cap_bytes == 16 * GiB and c.world_size == 1 and c.global_batch * c.seq_len == 8 * 2048
    z2 = cases["memopt_zero2_offload_opt"]
    assert (z2.engine, z2.stage, z2.offload_optimizer, z2.offload_params) == ("deepspeed", 2, "cpu", "none")
    b = cases["baseline_zero3_offload"]
    assert b.ds_defaults and b.ckpt_impl == "hf" and not b.expandable_segments
    assert b.micro_batch_candidates == (8, 4, 2, 1) and b.micro_batch == 8
    assert cases["baseline_fsdp2_offload"].offload_params == "cpu"
    two = {c.id: c for c in sc.two_gpu_cases()}
    assert set(two) == {"memopt_fsdp2_x2", "memopt_zero3_x2", "baseline_fsdp2_x2", "baseline_zero3_offload_x2"}
    assert all(two[c.compare_to].role == "baseline" for c in two.values() if c.role == "memopt")
    # the baselines as issue 5 describes them: HF checkpointing, the largest per-rank micro-batch first
    zero = two["baseline_zero3_offload_x2"]
    assert (zero.offload_optimizer, zero.offload_params, zero.ds_defaults) == ("cpu", "cpu", True)
    assert two["baseline_fsdp2_x2"].micro_batch_candidates == (4, 2, 1) and zero.ckpt_impl == "hf"


def test_case_round_trip_and_errors() -> None:
    c = sc.single_gpu_cases()[0].replace(micro_batch=2, checkpointing=Checkpointing(mode="full", num_blocks=14))
    again = sc.ShardedCase.from_dict(json.loads(json.dumps(c.to_dict())))
    assert again == c and again.grad_accum == 4
    with pytest.raises(ValueError, match="multiple of world_size x micro_batch"):
        sc.ShardedCase(id="x", global_batch=8, micro_batch=3)
    with pytest.raises(ValueError, match="FSDP2 is stage 3"):
        sc.ShardedCase(id="x", engine="fsdp2", stage=2)
    with pytest.raises(ValueError, match="offload_params needs stage=3"):
        sc.ShardedCase(id="x", engine="deepspeed", stage=2, offload_params="cpu", offload_optimizer="cpu")
    with pytest.raises(ValueError, match="unknown case keys"):
        sc.ShardedCase.from_dict({"id": "x", "bogus": 1})


def test_deepspeed_configs() -> None:
    cases = {c.id: c for c in sc.single_gpu_cases()}
    z2 = sc.case_deepspeed_config(cases["memopt_zero2_offload_opt"].replace(micro_batch=2))
    zo = z2["zero_optimization"]
    assert zo["stage"] == 2 and zo["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zo["reduce_bucket_size"] == MEMOPT_BUCKET_ELEMENTS and zo["overlap_comm"] is True
    assert z2["train_micro_batch_size_per_gpu"] == 2 and z2["gradient_accumulation_steps"] == 4
    assert z2["train_batch_size"] == 8 and z2["bf16"] == {"enabled": True}
    base = sc.case_deepspeed_config(cases["baseline_zero3_offload"].replace(micro_batch=2))
    bz = base["zero_optimization"]
    assert bz == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                  "offload_param": {"device": "cpu", "pin_memory": True}}  # DeepSpeed's default buckets
    assert base["train_batch_size"] == 8 and base["optimizer"]["type"] == "AdamW"
    with pytest.raises(ValueError, match="runs FSDP2"):
        sc.case_deepspeed_config(cases["memopt_fsdp2_offload"])


# -- predictions: hand arithmetic of the engine's bytes ------------------------------------------------------
def test_model_facts_llama32_3b() -> None:
    f = sc.model_facts("llama32_3b")
    h, inter, v, kv = 3072, 8192, 128256, 8 * 128
    block = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    assert f.unit_params == (block,) * 28
    assert f.tied_params == f.largest_param == f.largest_module_params == v * h  # tied embedding / head
    assert f.root_params == v * h + h
    assert f.num_params == 28 * block + v * h + h
    assert f.num_tensors == 28 * 9 + 2  # 7 linears + 2 norms per block; the tied embedding/head and the final norm


def _point(part: str, block: int | None, name: str = "x", after: bool = False) -> sc.TimelinePoint:
    return sc.TimelinePoint(part=part, block=block, name=name, base=0, peak=0, after_blocks=after)


def test_engine_bytes_zero2_offload() -> None:
    f = sc.model_facts("llama32_3b")
    case = sc.single_gpu_cases()[0]
    fwd = sc.engine_bytes_at(case, f, _point("forward", 3))
    bwd = sc.engine_bytes_at(case, f, _point("backward", 3))
    assert fwd["states"] == bwd["states"] == 2 * f.num_params  # bf16 weights only: grads and Adam on the host
    assert fwd["buffers"] == 2 * f.largest_param  # the gradient-offload staging buffer
    assert bwd["buffers"] == 2 * f.largest_param + 2 * MEMOPT_BUCKET_ELEMENTS * 2  # + two reduce buckets


def test_engine_bytes_zero3_full_offload_leaves_gathered_params_only() -> None:
    f = sc.model_facts("llama32_3b")
    case = {c.id: c for c in sc.single_gpu_cases()}["memopt_zero3_offload_all"]
    fwd = sc.engine_bytes_at(case, f, _point("forward", 3))
    bwd = sc.engine_bytes_at(case, f, _point("backward", 3))
    step = sc.engine_bytes_at(case, f, None)
    # model states: nothing but DeepSpeed's persistent small parameters (norms) in bf16
    assert fwd["states"] == 2 * f.small_params < 1 * 2**20
    live = DS_DEFAULT_MAX_LIVE + MEMOPT_BUCKET_ELEMENTS  # max live parameters + the prefetch bucket
    assert fwd["buffers"] == 2 * live
    assert bwd["buffers"] == 2 * live + 2 * MEMOPT_BUCKET_ELEMENTS * 2  # + the reduce bucket, doubled (overlap)
    assert step["buffers"] == 0  # the optimizer steps on the host


def test_engine_bytes_fsdp2_offload() -> None:
    f = sc.model_facts("llama32_3b")
    case = {c.id: c for c in sc.single_gpu_cases()}["memopt_fsdp2_offload"]
    u, root = f.unit_params[0], f.root_params
    assert sc.engine_bytes_at(case, f, None) == {"states": 0, "buffers": 0}
    # forward of a block: the root gathered (bf16), the unit unsharded + its flat all-gather output, and the copy-in
    # of fp32 shards brought from the host and cast
    assert sc.engine_bytes_at(case, f, _point("forward", 5))["buffers"] == root * 2 + 2 * u * 2 + u * (4 + 2)
    bwd = sc.engine_bytes_at(case, f, _point("backward", 5))["buffers"]
    root_grads = (root - f.tied_params) * 2  # the tied embedding's gradient is an autograd temporary
    assert bwd == root * 2 + root_grads + 2 * u * 2 + u * 6 + u * 2 + u * 4 + u * 4
    # head and loss backward: the root, and the last block's all-gather output (prefetched when the root's backward
    # starts)
    assert sc.engine_bytes_at(case, f, _point("backward", None, "backward[0]"))["buffers"] == \
        root * 2 + root_grads + u * 2


def test_engine_bytes_two_gpu_states() -> None:
    f = sc.model_facts("llama32_3b")
    cases = {c.id: c for c in sc.two_gpu_cases()}
    shard = -(-f.num_params // 2)
    assert sc.engine_bytes_at(cases["memopt_fsdp2_x2"], f, _point("forward", 0))["states"] == shard * 16
    assert sc.engine_bytes_at(cases["memopt_zero3_x2"], f, _point("forward", 0))["states"] == shard * (2 + 2 + 12)


def test_engine_bytes_fsdp2_sharded_grads_follow_grad_accum() -> None:
    """zero_grad(set_to_none=True): at one micro-batch per step the fp32 sharded gradients appear as backward
    reduce-scatters the blocks; with accumulation every micro-batch after the first holds them all."""
    f = sc.model_facts("llama32_3b")
    case = {c.id: c for c in sc.two_gpu_cases()}["memopt_fsdp2_x2"].replace(micro_batch=4)
    assert case.grad_accum == 1
    shard, n = -(-f.num_params // 2), len(f.unit_params)
    ushard = -(-f.unit_params[0] // 2)
    no_grads = shard * (4 + 8)  # fp32 parameters + Adam
    assert sc.engine_bytes_at(case, f, _point("forward", 3))["states"] == no_grads
    assert sc.engine_bytes_at(case, f, _point("backward", None, "backward[0]"))["states"] == no_grads
    assert sc.engine_bytes_at(case, f, _point("backward", 20))["states"] == no_grads + (n - 21) * ushard * 4
    assert sc.engine_bytes_at(case, f, _point("backward", None, "emb", after=True))["states"] == \
        no_grads + n * ushard * 4
    assert sc.engine_bytes_at(case, f, None)["states"] == shard * 16  # the optimizer step: all of them
    accum = case.replace(micro_batch=2)
    assert sc.engine_bytes_at(accum, f, _point("backward", None, "backward[0]"))["states"] == shard * 16
    # the two-H200 rows at 4 x 1: 5.98 GiB of the 5.73 GiB over-prediction
    assert (shard * 4) / GiB == pytest.approx(5.98, abs=0.01)


@pytest.fixture(scope="module")
def tiny_predictions() -> dict[str, dict[str, Any]]:
    cases = sc.single_gpu_cases("tiny_llama", cap_bytes=1 * GiB, global_batch=4, seq_len=64)
    return {c.id: sc.predict_case(c.replace(micro_batch=2), with_time=False) for c in cases}


def test_predictions_positive_and_consistent(tiny_predictions: dict[str, dict[str, Any]]) -> None:
    f = sc.model_facts("tiny_llama")
    for cid, p in tiny_predictions.items():
        parts = p["predicted_parts"]
        assert p["predicted_peak_allocated_bytes"] > 0, cid
        assert p["predicted_peak_allocated_bytes"] == sum(parts.values()), cid
        assert p["predicted_peak_reserved_bytes"] >= p["predicted_peak_allocated_bytes"]
        assert p["predicted_peak_reserved_bytes"] % (2 * 2**20) == 0
        assert parts["activations"] > 0 and p["predicted_fits_cap"]
        assert p["predicted_host_bytes_per_rank"] > 12 * f.num_params  # fp32 master + Adam on the host
    z2 = tiny_predictions["memopt_zero2_offload_opt"]
    assert z2["predicted_parts"]["model_states"] == 2 * f.num_params
    # ZeRO-2 offload with accumulation: the pinned master, fp32 grads and bf16 staging (each a power of two), the
    # largest parameter's bf16 gradient buffer, Adam's pageable moments and the 16-bit accumulated gradients
    pinned = sum(1 << (n - 1).bit_length() for n in (4 * f.num_params, 4 * f.num_params, 2 * f.num_params,
                                                     2 * f.largest_module_params))
    assert z2["predicted_host_bytes_per_rank"] == pinned + f.num_params * (8 + 2)
    z3 = tiny_predictions["memopt_zero3_offload_all"]
    assert z3["predicted_parts"]["model_states"] == 2 * f.small_params
    # the tiny model is smaller than max live parameters: all of it may be gathered at once, in bf16
    assert z3["predicted_parts"]["engine_buffers"] >= 2 * f.num_params
    assert tiny_predictions["memopt_fsdp2_offload"]["predicted_parts"]["model_states"] == 0


def test_activation_timeline_grads_modes() -> None:
    strat = sc.single_gpu_cases("tiny_llama", global_batch=4, seq_len=64)[0].replace(micro_batch=2).strategy()
    transient = sc.activation_timeline("tiny_llama", strat, seq_len=64, grads="transient")
    skipped = sc.activation_timeline("tiny_llama", strat, seq_len=64, grads="skip")
    assert [p.name for p in transient] == [p.name for p in skipped]
    assert {p.part for p in transient} == {"forward", "backward"}
    assert max(p.peak for p in transient) >= max(p.peak for p in skipped) > 0
    assert all(p.peak >= p.base >= 0 for p in transient)
    assert any(p.after_blocks for p in transient if p.part == "backward")
    with pytest.raises(ValueError, match="grads must be"):
        sc.activation_timeline("tiny_llama", strat, seq_len=64, grads="keep")


def test_choose_memopt_setting_fits_and_raises() -> None:
    case = sc.single_gpu_cases("tiny_llama", cap_bytes=1 * GiB, global_batch=4, seq_len=64)[0]
    chosen, pred = sc.choose_memopt_setting(case, max_timed=2)
    assert pred["predicted_peak_reserved_bytes"] <= sc.PLAN_HEADROOM * case.cap_bytes
    assert chosen.global_batch == 4 and 4 % chosen.micro_batch == 0 and pred["predicted_step_s"] > 0
    with pytest.raises(ValueError, match="smallest predicted peak"):
        sc.choose_memopt_setting(case.replace(cap_bytes=1024))


# -- the report -------------------------------------------------------------------------------------------
def _row(cid: str, pred: int, meas: int, step: float, *, role: str = "memopt", compare: str = "", ok: bool = True,
         oom: bool = False) -> dict[str, Any]:
    return {"case": {"id": cid, "role": role, "cap_bytes": 16 * GiB, "compare_to": compare, "micro_batch": 1},
            "rank": 0, "ok": ok, "oom": oom, "fits_under_cap": ok and not oom,
            "predicted_peak_allocated_bytes": pred, "measured_peak_allocated_bytes": meas,
            "predicted_peak_reserved_bytes": pred, "measured_peak_reserved_bytes": meas, "measured_step_s": step}


def test_report_hand_computed_errors(tmp_path: Path) -> None:
    rows = [_row("a", 102, 100, 2.0, compare="base"),  # +2%
            _row("b", 95, 100, 4.0, compare="base"),  # -5%
            _row("c", 101, 100, 1.0),  # +1%
            _row("base", 100, 80, 3.0, role="baseline"),  # +25%
            _row("base@mb4", 0, 0, 0.0, role="baseline", oom=True)]
    rep = sc.report_rows(rows)
    errs = {e["id"]: e["err_allocated"] for e in rep["rows"]}
    assert errs["a"] == pytest.approx(0.02) and errs["b"] == pytest.approx(-0.05)
    assert errs["base"] == pytest.approx(0.25) and errs["base@mb4"] is None
    s = rep["summary"]
    # |errors| of the rows that ran and fitted: 2%, 5%, 1%, 25% -> median 3.5%, max 25%
    assert s["allocated"]["median"] == pytest.approx(0.035) and s["allocated"]["max"] == pytest.approx(0.25)
    assert s["allocated"]["n"] == 4 and s["allocated_within_targets"] is False
    assert s["memopt_ooms_under_cap"] == []
    speed = {x["id"]: x["speedup"] for x in s["speed"]}
    assert speed == {"a": pytest.approx(1.5), "b": pytest.approx(0.75)}
    assert s["speed_target_met"] is False
    md = sc.report_markdown(rep)
    assert "| a | 0 |" in md and "+2.0%" in md and "-5.0%" in md and "1.50x" in md and "OOM" in md
    good = sc.report_rows([_row("a", 102, 100, 1.0), _row("c", 101, 100, 1.0), _row("d", 97, 100, 1.0)])
    assert good["summary"]["allocated_within_targets"] is True  # median 2%, max 3%
    oom = sc.report_rows([_row("a", 100, 100, 1.0, oom=True)])
    assert oom["summary"]["memopt_ooms_under_cap"] == ["a"] and oom["summary"]["allocated"]["n"] == 0


# -- the script without a GPU -------------------------------------------------------------------------------
def test_script_plan_only(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    mod = _script()
    assert mod.main(["--plan-only", "--model", "tiny_llama", "--cap-gib", "1", "--out", str(tmp_path),
                     "--cases", "memopt_zero3_offload_all,baseline_fsdp2_offload"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    ids = [x["id"] for x in lines]
    assert ids[0] == "memopt_zero3_offload_all" and set(ids[1:]) == {"baseline_fsdp2_offload"}
    assert [x["case"]["micro_batch"] for x in lines[1:]] == [8, 4, 2, 1]  # every candidate under 1.25x the cap
    with pytest.raises(SystemExit, match="unknown case ids"):
        mod.main(["--plan-only", "--model", "tiny_llama", "--out", str(tmp_path), "--cases", "nope"])


def test_script_run_with_fake_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run loop: a baseline steps down after an OOM, rows carry predictions, the report reads them."""
    mod = _script()
    launched: list[tuple[str, int]] = []

    def fake_launch(case: sc.ShardedCase, prefix: Path, timeout: float) -> list[dict[str, Any]]:
        launched.append((case.id, case.micro_batch))
        oom = case.role == "baseline" and case.micro_batch > 2
        return [{"case": case.to_dict(), "label": case.label(), "rank": 0, "ok": True, "oom": oom,
                 "fits_under_cap": not oom, "measured_peak_allocated_bytes": 100 * 2**20,
                 "measured_peak_reserved_bytes": 110 * 2**20, "measured_step_s": 1.0 if case.role == "memopt" else 2.0}]

    monkeypatch.setattr(mod, "launch", fake_launch)
    out = tmp_path / "run"
    assert mod.main(["--model", "tiny_llama", "--cap-gib", "1", "--out", str(out), "--no-prebuild",
                     "--cases", "memopt_fsdp2_offload,baseline_fsdp2_offload"]) == 0
    assert launched[0][0] == "memopt_fsdp2_offload"
    assert launched[1:] == [("baseline_fsdp2_offload", 8), ("baseline_fsdp2_offload", 4),
                            ("baseline_fsdp2_offload", 2)]
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["case"]["id"] for r in rows] == ["memopt_fsdp2_offload", "baseline_fsdp2_offload@mb8",
                                               "baseline_fsdp2_offload@mb4", "baseline_fsdp2_offload"]
    assert all(r["predicted_peak_allocated_bytes"] > 0 for r in rows)
    rep = mod.report([str(out)], str(tmp_path / "bench" / "sharding_h200"))
    assert (tmp_path / "bench" / "sharding_h200.md").exists()
    assert rep["summary"]["speed"] == [{"id": "memopt_fsdp2_offload", "baseline": "baseline_fsdp2_offload",
                                        "speedup": 2.0}]
    assert rep["summary"]["memopt_ooms_under_cap"] == []
    # a deadline already passed: nothing launches, every case is a skipped row
    launched.clear()
    out2 = tmp_path / "late"
    assert mod.main(["--model", "tiny_llama", "--cap-gib", "1", "--out", str(out2), "--no-prebuild",
                     "--deadline", "0.001", "--cases", "memopt_zero2_offload_opt"]) == 0
    assert launched == []
    (row,) = [json.loads(x) for x in (out2 / "results.jsonl").read_text().splitlines()]
    assert row["skipped"] and "deadline" in row["error"]


def test_deepspeed_reads_the_arch_list_without_arch_specific_suffixes():
    from memopt.distributed.deepspeed_engine import plain_arch_list, prepare_deepspeed_build_env

    assert plain_arch_list("9.0a") == "9.0"
    assert plain_arch_list("8.0 9.0a;10.0a+PTX") == "8.0;9.0;10.0+PTX"
    assert plain_arch_list("9.0;9.0a") == "9.0"
    assert plain_arch_list(None) is None
    env = {"TORCH_CUDA_ARCH_LIST": "9.0a"}
    prepare_deepspeed_build_env(env)
    # what DeepSpeed 0.19.8's builder does with each entry (op_builder/builder.py, compute_capability_args)
    assert [tuple(int(p.split("+")[0]) for p in cc.split(".")) for cc in env["TORCH_CUDA_ARCH_LIST"].split(";")] \
        == [(9, 0)]
    empty: dict[str, str] = {}
    prepare_deepspeed_build_env(empty)
    assert empty == {}  # unset stays unset: DeepSpeed probes the devices
