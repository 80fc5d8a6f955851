"""An optimizer (and a scheduler on it) built before memopt.wrap, as plain PyTorch loops build them: memopt trains
with the same class, parameter groups, hyper-parameters and state, exactly as the unwrapped loop; what it cannot
follow is one line."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.errors import InputError
from memopt.techniques.optimizer_instance import optimizer_factory


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 5))


def _groups(m: nn.Sequential) -> list[dict]:
    """Weight decay on the matrices only, the biases at their own learning rate."""
    return [{"params": [m[0].weight, m[2].weight], "weight_decay": 0.1},
            {"params": [m[0].bias, m[2].bias], "weight_decay": 0.0, "lr": 0.05}]


def _batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)]


def _hand_step(model, opt, sched, batch) -> float:
    loss = F.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return loss.item()


@pytest.mark.parametrize("micro", [8, 2])
def test_a_built_optimizer_and_scheduler_train_as_the_unwrapped_loop(micro):
    """Groups with their own lr and weight decay, a StepLR, and one step already taken (a resumed run's moments)."""
    batches = _batches()
    ref, model = _mlp(), _mlp()
    ref_opt = torch.optim.AdamW(_groups(ref), lr=0.01)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5)
    opt = torch.optim.AdamW(_groups(model), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    _hand_step(ref, ref_opt, ref_sched, batches[0])
    _hand_step(model, opt, sched, batches[0])

    w = memopt.wrap(model, budget="4GB", sample=batches[0], hardware="h100_80gb", device="cpu", use_cache=False,
                    guard=False, optimizer=opt, lr_scheduler=sched, loss_fn=lambda out, b: F.cross_entropy(out, b[1]),
                    pins={"micro_batch_size": micro, "precision": "fp32"})
    want = [_hand_step(ref, ref_opt, ref_sched, b) for b in batches[1:]]
    got = [w.step(b) for b in batches[1:]]
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert [g["lr"] for g in w.optimizer.param_groups] == pytest.approx([g["lr"] for g in ref_opt.param_groups])
    assert type(w.optimizer) is torch.optim.AdamW


@pytest.mark.parametrize("pin", ["adamw_fused", "adamw"])
def test_an_optimizer_pin_of_the_instances_algorithm_keeps_its_groups_and_state(pin):
    """Pinning the fused (or one-tensor) AdamW beside the user's AdamW builds that kernel from the user's groups,
    hyper-parameters and moments, not a fresh optimizer at memopt's defaults."""
    batches = _batches()
    ref, model = _mlp(), _mlp()
    ref_opt = torch.optim.AdamW(_groups(ref), lr=0.01, betas=(0.8, 0.95), eps=1e-6)
    opt = torch.optim.AdamW(_groups(model), lr=0.01, betas=(0.8, 0.95), eps=1e-6)
    for m, o in ((ref, ref_opt), (model, opt)):
        F.cross_entropy(m(batches[0][0]), batches[0][1]).backward()
        o.step()
        o.zero_grad(set_to_none=True)

    w = memopt.wrap(model, budget="4GB", sample=batches[0], hardware="h100_80gb", device="cpu", use_cache=False,
                    guard=False, optimizer=opt, loss_fn=lambda out, b: F.cross_entropy(out, b[1]),
                    pins={"optimizer": pin, "precision": "fp32", "micro_batch_size": 8})
    assert w.plan.strategy.optimizer == pin
    groups = w.optimizer.param_groups
    assert [(g["lr"], g["weight_decay"], g["betas"], g["eps"]) for g in groups] == \
        [(g["lr"], g["weight_decay"], g["betas"], g["eps"]) for g in ref_opt.param_groups]
    assert all(bool(g["fused"]) == (pin == "adamw_fused") for g in groups)
    for b in batches[1:]:
        F.cross_entropy(ref(b[0]), b[1]).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        w.step(b)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_an_optimizer_pin_of_another_algorithm_than_the_users_is_one_line():
    model = _mlp()
    common = {"budget": "4GB", "sample": _batches(1)[0], "hardware": "h100_80gb", "device": "cpu", "use_cache": False,
              "loss_fn": lambda out, b: F.cross_entropy(out, b[1]), "pins": {"optimizer": "sgd"}}
    with pytest.raises(InputError, match="conflicts with the AdamW passed as optimizer=") as err:
        memopt.wrap(model, optimizer=torch.optim.AdamW(_groups(model), lr=0.01), **common)
    assert "\n" not in str(err.value).strip()
    with pytest.raises(InputError, match="conflicts with the optimizer callable"):
        memopt.wrap(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.01), **common)
    with pytest.raises(InputError, match="conflicts with the AdamW passed as optimizer="):
        memopt.plan(model, common["sample"], budget="4GB", hardware="h100_80gb", pins={"optimizer": "sgd"},
                    optimizer=torch.optim.AdamW(_groups(model), lr=0.01), loss_fn=common["loss_fn"])


def test_what_an_instance_cannot_follow_is_one_line():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sample = _batches(1)[0]
    common = {"budget": "4GB", "sample": sample, "hardware": "h100_80gb", "device": "cpu", "use_cache": False,
              "loss_fn": lambda out, b: F.cross_entropy(out, b[1])}
    with pytest.raises(ValueError, match="lr given beside an optimizer you build yourself"):
        memopt.wrap(model, optimizer=opt, lr=0.5, **common)
    with pytest.raises(ValueError, match="lr given beside an optimizer you build yourself"):
        memopt.wrap(model, optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0), lr=0.5, **common)
    with pytest.raises(ValueError, match="not parameters of the model"):
        memopt.wrap(_mlp(), optimizer=opt, **common)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(ValueError, match="pass that optimizer too"):
        memopt.wrap(model, lr_scheduler=sched, **common)
    # a plan that trains other tensors than the model's own (adapters) cannot map the instance's groups onto them
    build = optimizer_factory(opt, model)
    with pytest.raises(ValueError, match="adapters or quantization"):
        build([nn.Parameter(torch.zeros(3))])


def test_plan_takes_an_instance_as_a_user_optimizer():
    model = _mlp()
    plan = memopt.plan(model, _batches(1)[0], budget="4GB", hardware="h100_80gb",
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                       loss_fn=lambda out, b: F.cross_entropy(out, b[1]))
    assert plan.fits and plan.strategy.optimizer == "user"


def test_a_fresh_scheduler_steps_without_torch_taking_it_for_a_misordered_step():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    batch = _batches(1)[0]
    w = memopt.wrap(model, budget="4GB", sample=batch, hardware="h100_80gb", device="cpu", use_cache=False,
                    guard=False, optimizer=opt, lr_scheduler=sched, loss_fn=lambda out, b: F.cross_entropy(out, b[1]),
                    pins={"precision": "fp32"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w.step(batch)
        w.step(batch)
    assert not [str(c.message) for c in caught if "lr_scheduler" in str(c.message) or "overridden" in str(c.message)]
    assert w.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)


_S = torch.optim.lr_scheduler
_COMPOSED = {
    "sequential": lambda o: _S.SequentialLR(o, [_S.LinearLR(o, 0.1, 1.0, total_iters=2), _S.ExponentialLR(o, 0.5)],
                                            milestones=[2]),
    "chained": lambda o: _S.ChainedScheduler([_S.ConstantLR(o, 0.1, total_iters=2), _S.ExponentialLR(o, 0.5)]),
    # a sequence inside a chain: the innermost schedulers write the rate too
    "nested": lambda o: _S.ChainedScheduler([_S.SequentialLR(o, [_S.ConstantLR(o, 0.5, total_iters=1),
                                                                  _S.StepLR(o, 1, gamma=0.5)], milestones=[1]),
                                             _S.ExponentialLR(o, 0.9)]),
}


@pytest.mark.parametrize("kind", sorted(_COMPOSED))
def test_a_composed_scheduler_drives_the_optimizer_memopt_builds(kind):
    """SequentialLR and ChainedScheduler instances step schedulers of their own: every one of them follows memopt's
    optimizer, so the rates and the weights are the hand loop's, step by step."""
    batches = _batches(5)
    ref, model = _mlp(), _mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    ref_sched = _COMPOSED[kind](ref_opt)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = _COMPOSED[kind](opt)
    w = memopt.wrap(model, budget="4GB", sample=batches[0], hardware="h100_80gb", device="cpu", use_cache=False,
                    guard=False, optimizer=opt, lr_scheduler=sched, loss_fn=lambda out, b: F.cross_entropy(out, b[1]),
                    pins={"precision": "fp32"})
    want, got = [], []
    for b in batches:
        _hand_step(ref, ref_opt, ref_sched, b)
        want.append(ref_opt.param_groups[0]["lr"])
        w.step(b)
        got.append(w.optimizer.param_groups[0]["lr"])
    assert got == pytest.approx(want, rel=1e-12)
    assert len(set(want)) > 2  # the schedule moved the rate
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _common(sample) -> dict:
    return {"budget": "4GB", "sample": sample, "hardware": "h100_80gb", "device": "cpu", "use_cache": False,
            "guard": False, "loss_fn": lambda out, b: F.cross_entropy(out, b[1]), "pins": {"precision": "fp32"}}


def test_a_scheduler_built_on_the_optimizer_but_not_passed_is_refused():
    """memopt trains with its own optimizer, built from the one passed: a StepLR the user keeps stepping on theirs
    would change nothing that trains, so wrap asks for it as lr_scheduler=; passed, it drives the training."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.1)
    with pytest.raises(memopt.InputError, match=r"^the optimizer passed to memopt.wrap has a learning-rate scheduler "
                       r"built on it.*: pass lr_scheduler=<your scheduler> to memopt.wrap"):
        memopt.wrap(model, optimizer=opt, **_common(_batches(1)[0]))
    w = memopt.wrap(model, optimizer=opt, lr_scheduler=sched, **_common(_batches(1)[0]))
    w.step(_batches(1)[0])
    assert w.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    # an optimizer no scheduler was built on is taken as it is
    plain = _mlp()
    memopt.wrap(plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.5), **_common(_batches(1)[0]))


def test_a_scheduler_that_needs_a_metric_is_refused_before_anything_trains():
    """ReduceLROnPlateau steps on a validation metric memopt does not have: refused at wrap (an instance, or a
    callable that builds one), with the way to run it beside memopt."""
    batch = _batches(1)[0]
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    with pytest.raises(memopt.InputError, match=r"^lr_scheduler= is a ReduceLROnPlateau, whose step\(\) needs "
                       r"'metrics'.*build it on wrapped.optimizer after memopt.wrap and call sched.step\(val_loss\)"):
        memopt.wrap(model, optimizer=opt, lr_scheduler=plateau, **_common(batch))
    with pytest.raises(memopt.InputError, match=r"^the scheduler lr_scheduler= built is a ReduceLROnPlateau"):
        memopt.wrap(model, lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau, **_common(batch))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_scheduler_that_raises_leaves_the_step_taken_and_counted():
    """The scheduler steps after the weights moved: when it raises, the step is counted where it happened (the
    wrapper's steps_done and the train step's), never a step taken and not counted."""
    batch = _batches(1)[0]
    ref, model = _mlp(), _mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.cross_entropy(ref(batch[0]), batch[1]).backward()
    ref_opt.step()

    def factor(step: int) -> float:
        if step >= 1:
            raise ArithmeticError("no rate past the first step")
        return 1.0

    w = memopt.wrap(model, optimizer="sgd", lr=0.1, lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, factor),
                    **_common(batch))
    with pytest.raises(RuntimeError, match=r"^step 1 updated the weights and is counted, but lr_scheduler.step\(\) "
                       r"then raised ArithmeticError: no rate past the first step"):
        w.step(batch)
    assert w.steps_done == 1
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_an_optimizer_whose_step_needs_a_closure_is_refused_in_one_line():
    """LBFGS re-evaluates the loss inside its step; memopt's step gives it no closure: refused at wrap and plan,
    an instance or a callable that builds one."""
    batch = _batches(1)[0]
    model = _mlp()
    message = r"is a LBFGS, whose step\(\) needs a closure .*use an optimizer whose step\(\) takes no closure"
    with pytest.raises(memopt.InputError, match=r"^optimizer= " + message):
        memopt.wrap(model, optimizer=torch.optim.LBFGS(model.parameters()), **_common(batch))
    with pytest.raises(memopt.InputError, match=r"^the optimizer optimizer= built " + message):
        memopt.wrap(model, optimizer=lambda ps: torch.optim.LBFGS(ps), **_common(batch))
    with pytest.raises(memopt.InputError, match=r"^optimizer= " + message):
        memopt.plan(model, batch, budget="4GB", hardware="h100_80gb", optimizer=torch.optim.LBFGS(model.parameters()),
                    loss_fn=lambda out, b: F.cross_entropy(out, b[1]))


@pytest.fixture
def accelerator():
    """An accelerate Accelerator on the CPU; its process-wide state is reset after the test, so a later Accelerator
    (a Trainer's, on a GPU) is not taken for one of the same run."""
    accelerate = pytest.importorskip("accelerate")
    yield accelerate.Accelerator(cpu=True)
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.state.GradientState._reset_state()


def test_an_optimizer_accelerate_prepared_is_taken_for_the_torch_optimizer_inside_it(accelerator):
    """``model, opt = accelerator.prepare(model, opt)`` before memopt.wrap: the AcceleratedOptimizer's constructor
    takes an optimizer, not parameter groups; memopt builds from the torch optimizer inside it (its groups and
    hyper-parameters) and trains as the plain loop, and a scheduler built on the prepared optimizer drives it."""
    batches = _batches()
    ref, model = _mlp(), _mlp()
    ref_opt = torch.optim.SGD(_groups(ref), lr=0.1, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5)
    model, opt = accelerator.prepare(model, torch.optim.SGD(_groups(model), lr=0.1, momentum=0.9))
    assert type(opt).__name__ == "AcceleratedOptimizer"
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    w = memopt.wrap(model, optimizer=opt, lr_scheduler=sched, **{**_common(batches[0]), "pins": {
        "precision": "fp32", "micro_batch_size": 4}})
    want = [_hand_step(ref, ref_opt, ref_sched, b) for b in batches]
    got = [w.step(b) for b in batches]
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert type(w.optimizer) is torch.optim.SGD
    assert [g["lr"] for g in w.optimizer.param_groups] == pytest.approx([g["lr"] for g in ref_opt.param_groups])
    # a scheduler built on it and not passed is refused as one built on a torch optimizer is
    other = _mlp()
    other, other_opt = accelerator.prepare(other, torch.optim.SGD(other.parameters(), lr=0.1))
    torch.optim.lr_scheduler.StepLR(other_opt, 1)
    with pytest.raises(memopt.InputError, match="has a learning-rate scheduler built on it"):
        memopt.wrap(other, optimizer=other_opt, **_common(batches[0]))
