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
