"""Resuming a one-GPU wrap from ``wrapped.save``, on a CPU: under another precision the full-precision weights carry
over (fp32 masters included), another optimizer's checkpoint is refused before anything is loaded, a load that fails
half-way puts back everything it loaded, and the random generators continue as in an uninterrupted run."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import memopt
from memopt.models import SampleSpec, build_model, make_batch

SAMPLE = {"batch_size": 4, "seq_len": 32}
PRECISION_ARGS = {"fp32": {"pins": {"precision": "fp32"}},
                  "bf16_master": {"pins": {"precision": "bf16_master"}, "fidelity": "mixed"}}


def _batches(model_name: str, n: int, seed: int = 123) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sample = SampleSpec.parse(SAMPLE, model_name)
    return [make_batch(model_name, sample, generator=g) for _ in range(n)]


def _wrap(seed: int, model_name: str = "tiny_llama", *, weights: dict[str, torch.Tensor] | None = None,
          **kwargs: Any) -> Any:
    """A wrap of a freshly built model (its weights set to ``weights`` before wrapping, where given)."""
    torch.manual_seed(seed)
    model = build_model(model_name, device="cpu")
    if weights is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[name])
    return memopt.wrap(model, budget="4GB", sample=SAMPLE, hardware="h100_80gb", lr=1e-2, **kwargs)


def _full_precision(w: Any, checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 truth in ``w``'s checkpoint: its master where it holds one (one per trainable
    parameter, in their order), else its weight."""
    truth = {k: v.float() for k, v in checkpoint["model"].items()}
    masters = checkpoint.get("master_weights")
    if masters is not None:
        truth.update(zip([n for n, p in w.model.named_parameters() if p.requires_grad], masters["masters"]))
    return truth


def _params(w: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in w.model.named_parameters()}


def _masters(w: Any) -> list[torch.Tensor]:
    master = w._prepared.step.master
    return [m.detach().clone() for m in master.masters] if master is not None else []


def _optimizer_tensors(w: Any) -> list[torch.Tensor]:
    state = w.optimizer.state_dict()
    return [v.clone() for s in state["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]


def _same(a: list[torch.Tensor] | dict[str, torch.Tensor], b: list[torch.Tensor] | dict[str, torch.Tensor]) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(("saved", "loaded"), [("fp32", "bf16_master"), ("bf16_master", "fp32")])
def test_resuming_under_another_precision_continues_from_the_full_precision_weights(tmp_path: Path, saved: str,
                                                                                  loaded: str) -> None:
    """The resumed run is the run that starts from the checkpoint's fp32 truth (its masters where it has them) with
    its optimizer state: a bf16_master plan's masters start from that truth, not from the fresh model's weights, and
    an fp32 plan takes a bf16_master checkpoint's masters, not its bf16-rounded weights."""
    batches = _batches("tiny_llama", 6)
    first = _wrap(0, **PRECISION_ARGS[saved])
    for b in batches[:3]:
        first.step(b)
    path = first.save(tmp_path / "ckpt.pt")
    checkpoint = torch.load(path, weights_only=False)
    truth = _full_precision(first, checkpoint)

    resumed = _wrap(1, **PRECISION_ARGS[loaded])  # another initialization: nothing of it may survive the load
    resumed.load(path)
    names = [n for n, p in resumed.model.named_parameters() if p.requires_grad]
    dtype = next(resumed.model.parameters()).dtype
    assert _same(_params(resumed), {n: truth[n].to(dtype) for n in names})
    if loaded == "bf16_master":
        assert _same(_masters(resumed), [truth[n] for n in names])
    # the expected run: the truth in the model before wrapping (bf16_master's masters start from it), the
    # checkpoint's optimizer state loaded by torch
    expected = _wrap(2, weights=truth, **PRECISION_ARGS[loaded])
    expected.optimizer.load_state_dict(checkpoint["optimizer"])
    assert [resumed.step(b) for b in batches[3:]] == [expected.step(b) for b in batches[3:]]
    assert _same(_params(resumed), _params(expected)) and _same(_masters(resumed), _masters(expected))

    if saved == "bf16_master":  # a checkpoint that does not name its masters' parameters (as older ones) too
        checkpoint["master_weights"].pop("names")
        older = _wrap(3, **PRECISION_ARGS[loaded])
        older.load_state_dict(checkpoint)
        assert _same(_params(older), {n: truth[n] for n in names})


@pytest.mark.parametrize("older", [False, True], ids=["named class", "older checkpoint"])
@pytest.mark.parametrize(("saved", "wrapped"), [("sgd", "adamw"), ("adamw", "sgd")])
def test_another_optimizers_checkpoint_is_refused_before_anything_loads(tmp_path: Path, saved: str, wrapped: str,
                                                                        older: bool) -> None:
    batches = _batches("tiny_llama", 3)
    sgd = {"optimizer": "sgd", "optimizer_kwargs": {"momentum": 0.9}}
    kwargs = {"sgd": sgd, "adamw": {}}
    source = _wrap(0, **kwargs[saved])
    source.step(batches[0])
    state = torch.load(source.save(tmp_path / "ckpt.pt"), weights_only=False)
    if older:  # written before checkpoints named their optimizer's class: told apart by its keys
        state.pop("optimizer_class", None)
    w = _wrap(1, **kwargs[wrapped])
    w.step(batches[1])
    params, optimizer, groups = _params(w), _optimizer_tensors(w), str(w.optimizer.param_groups)
    rng = torch.get_rng_state()
    names = {"sgd": "SGD", "adamw": "AdamW"}
    theirs = "sgd" if older and saved == "sgd" else ("adamw_fused" if older else names[saved])
    value = "sgd" if saved == "sgd" else "adamw_fused"
    with pytest.raises(ValueError, match=rf"^this checkpoint holds the state of {theirs} and this wrap steps "
                                         rf"{names[wrapped]}.*: wrap with the optimizer it was saved with "
                                         rf"\(memopt.wrap\(\.\.\., optimizer='{value}'\)\), or load only its weights"):
        w.load_state_dict(state)
    assert _same(_params(w), params) and _same(_optimizer_tensors(w), optimizer)
    assert str(w.optimizer.param_groups) == groups and torch.equal(torch.get_rng_state(), rng)
    assert w.steps_done == 1
    # it trains on as before the refused load: the same step as its twin that never saw the checkpoint
    twin = _wrap(1, **kwargs[wrapped])
    twin.step(batches[1])
    assert w.step(batches[2]) == twin.step(batches[2]) and _same(_params(w), _params(twin))


def test_a_load_that_fails_half_way_puts_back_what_it_loaded(tmp_path: Path) -> None:
    """Parts whose state only their own load can check: a learning-rate schedule of another kind fails after the
    optimizer state loaded, a random generator state of another torch build after the weights and masters did."""
    batches = _batches("tiny_llama", 2)
    args = PRECISION_ARGS["bf16_master"]
    source = _wrap(0, lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), **args)
    source.step(batches[0])
    path = source.save(tmp_path / "ckpt.pt")
    w = _wrap(1, lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s), **args)
    w.step(batches[1])
    schedule = w._prepared.step.lr_scheduler

    def kept() -> tuple[Any, ...]:
        return (_params(w), _masters(w), _optimizer_tensors(w), str(w.optimizer.param_groups),
                str(schedule.state_dict()), torch.get_rng_state(), random.getstate())

    def unchanged(before: tuple[Any, ...]) -> bool:
        now = kept()
        return (_same(now[0], before[0]) and all(_same(a, b) for a, b in zip(now[1:3], before[1:3]))
                and now[3:5] == before[3:5] and torch.equal(now[5], before[5]) and now[6] == before[6])

    before = kept()
    with pytest.raises(ValueError, match=r"^this checkpoint's learning-rate schedule does not load into this wrap "
                                         r"\(KeyError: .*\), so nothing of it was loaded: resume from a checkpoint"):
        w.load(path)
    assert unchanged(before)

    state = torch.load(path, weights_only=False)
    del state["lr_scheduler"]
    state["rng_state"]["cpu"] = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^this checkpoint's random generator state does not load into this wrap "
                                         r"\(RuntimeError: .*\), so nothing of it was loaded"):
        w.load_state_dict(state)
    assert unchanged(before) and w.steps_done == 1
    # the same state with a sound generator state loads whole
    state["rng_state"]["cpu"] = source.state_dict()["rng_state"]["cpu"]
    w.load_state_dict(state)
    assert _same(_masters(w), _masters(source)) and _same(_params(w), _params(source))


def _run(w: Any, batches: list[Any]) -> list[tuple[float, float, float]]:
    """Each step's loss beside what the script draws from Python's and numpy's generators before it."""
    return [(random.random(), float(np.random.rand()), w.step(b)) for b in batches]


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_a_run_with_dropout_resumes_bit_identical(tmp_path: Path) -> None:
    batches = _batches("tiny_gpt2", 6)
    straight = _wrap(0, "tiny_gpt2")
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in straight.model.modules())
    _seed(1234)
    expected = _run(straight, batches)

    first = _wrap(0, "tiny_gpt2")
    _seed(1234)
    resumed = _run(first, batches[:3])
    path = first.save(tmp_path / "ckpt")
    _seed(999)  # a new process: other random states
    second = _wrap(0, "tiny_gpt2")
    second.load(path)
    resumed += _run(second, batches[3:])
    assert resumed == expected
    assert _same(_params(second), _params(straight))

    # a checkpoint written before checkpoints held random states still loads, and leaves the generators as they are
    state = torch.load(path, weights_only=False)
    del state["rng_state"]
    older = _wrap(0, "tiny_gpt2")
    generators = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    older.load_state_dict(state)
    assert older.steps_done == 3 and _same(_params(older), {n: v for n, v in state["model"].items()
                                                            if n in dict(older.model.named_parameters())})
    assert torch.equal(torch.get_rng_state(), generators[0]) and random.getstate() == generators[1]
    assert np.array_equal(np.random.get_state()[1], generators[2])
