"""``ShardedWrapped.save`` / ``load`` route to the engine's checkpoint format, restore the step and the data
position, and refuse a checkpoint written by the other engine with the way out in the message."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from memopt.distributed import ds_checkpoint
from memopt.distributed import wrapped as wrapped_module
from memopt.distributed.wrapped import ShardedWrapped
from memopt.techniques.sharding import ShardingSetting


def _wrapped(engine: str, stage: int) -> ShardedWrapped:
    w = object.__new__(ShardedWrapped)  # the routing only: no engine is built
    w.setting = ShardingSetting(engine=engine, stage=stage, world_size=1)
    w.model, w.optimizer = object(), object()
    w._step = SimpleNamespace(steps_done=7, samples_seen=56, lr_scheduler=None)
    return w


def test_deepspeed_save_and_load_carry_the_counters(tmp_path, monkeypatch):
    calls = {}

    def fake_save(engine, path, **kw):  # type: ignore[no-untyped-def]
        calls["save"] = kw
        path.mkdir(parents=True)
        (path / ds_checkpoint.CHECKPOINT_META).write_text(json.dumps({"engine": "deepspeed", **kw}))

    def fake_load(engine, path, **kw):  # type: ignore[no-untyped-def]
        calls["load"] = kw
        meta = json.loads((path / ds_checkpoint.CHECKPOINT_META).read_text())
        return {"steps_done": meta["steps_done"], "samples_seen": meta["samples_seen"]}

    monkeypatch.setattr(wrapped_module, "save_deepspeed", fake_save)  # where ShardedWrapped looks them up
    monkeypatch.setattr(wrapped_module, "load_deepspeed", fake_load)
    _wrapped("deepspeed", 2).save(tmp_path / "ck")
    assert calls["save"] == {"stage": 2, "world_size": 1, "steps_done": 7, "samples_seen": 56}
    resumed = _wrapped("deepspeed", 3)
    resumed._step.steps_done = resumed._step.samples_seen = 0
    assert resumed.load(tmp_path / "ck") == {"steps_done": 7, "samples_seen": 56}
    assert calls["load"] == {"stage": 3, "world_size": 1}  # the new layout: load_deepspeed converts
    assert (resumed.steps_done, resumed.samples_seen) == (7, 56)


def test_a_checkpoint_does_not_cross_engines(tmp_path):
    ds_dir = tmp_path / "ds"
    ds_dir.mkdir()
    (ds_dir / ds_checkpoint.CHECKPOINT_META).write_text("{}")
    with pytest.raises(ValueError, match=r"written by DeepSpeed and this plan trains with fsdp2.*same engine"):
        _wrapped("fsdp2", 3).load(ds_dir)
    dcp_dir = tmp_path / "dcp"
    dcp_dir.mkdir()
    with pytest.raises(ValueError, match=r"written by FSDP2/DDP .* trains with deepspeed"):
        _wrapped("deepspeed", 3).load(dcp_dir)


def test_load_of_a_folder_without_a_checkpoint_says_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match=r"memopt_checkpoint\.json is missing"):
        ds_checkpoint.load_deepspeed(object(), tmp_path, stage=2, world_size=1)


def test_a_model_on_meta_needs_its_weights(tmp_path):
    """A sharded plan given a model built on the meta device and no checkpoint: the error says what to pass."""
    import torch

    from memopt.strategy import Strategy

    from . import _workers as w

    with torch.device("meta"):
        model = w.tiny_model()
    setting = ShardingSetting(engine="deepspeed", stage=3, world_size=1)
    plan = SimpleNamespace(strategy=Strategy(precision="fp32", extras=(("sharding", setting),)), budget_bytes=2**33,
                           prediction={}, global_batch=8)
    with pytest.raises(ValueError, match=r"meta device: pass checkpoint=<safetensors file\(s\)>"):
        ShardedWrapped(model, plan, device="cpu")


def test_a_wrap_that_fails_after_starting_its_process_group_leaves_nothing_behind(monkeypatch):
    """memopt starts a one-process group (and the launcher variables) for a one-GPU offload engine; when building
    the engine then fails, the group is destroyed, the variables taken back and the model's changes undone: left
    behind, every later Trainer in the process took itself for one rank of a job (accelerate wrapped its model in
    DDP) and the blocks stayed checkpointed."""
    import os

    import torch.distributed as dist

    from memopt.strategy import Checkpointing, Strategy

    from . import _workers as w

    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    for name in launcher:
        monkeypatch.delenv(name, raising=False)
    model = w.tiny_model()
    forwards = [b.__dict__.get("forward") for b in model.layers]
    seen = {}

    def failing_engine(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen["group"] = dist.is_initialized()
        seen["checkpointed"] = [b.__dict__.get("forward") is not None for b in model.layers]
        raise RuntimeError("the engine could not be built")

    monkeypatch.setattr(ShardedWrapped, "_engine", failing_engine)
    setting = ShardingSetting(engine="fsdp2", stage=3, world_size=1)
    plan = SimpleNamespace(strategy=Strategy(precision="fp32", checkpointing=Checkpointing(mode="full"),
                                             extras=(("sharding", setting),)),
                           budget_bytes=2**33, prediction={}, global_batch=8)
    with pytest.raises(RuntimeError, match="the engine could not be built"):
        ShardedWrapped(model, plan, device="cpu")
    assert seen == {"group": True, "checkpointed": [True] * len(model.layers)}  # it got that far
    assert not dist.is_initialized()
    assert [name for name in launcher if name in os.environ] == []
    assert [b.__dict__.get("forward") for b in model.layers] == forwards
