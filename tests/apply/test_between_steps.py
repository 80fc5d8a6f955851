"""What a step finds when it starts, and what it does with it: gradients another model's step left on its parameters
(a GAN), parameters unfrozen since the wrap, a learning rate written on the optimizer the user passed, the caller's
grad mode, a wrapper already closed, a state loaded into the optimizer the user passed, weights written into a
bf16_master model, steps taken by the hand-written loop. Compared with the unwrapped loop, same seed, SGD."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from tests.reference_loop import losses_of_plain_loop

KW = {"budget": "4GB", "hardware": "h100_80gb", "device": "cpu"}


def _batches(n: int, width: int = 6, z: int = 4, b: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(b, width, generator=g), torch.randn(b, z, generator=g)) for _ in range(n)]


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_gan_step_starts_from_no_gradient_as_the_loop_that_zeroes_them_does():
    """DCGAN's order: the discriminator's step, then the generator's, whose loss backpropagates into the
    discriminator too. The discriminator's next step must not add what that left on its parameters."""
    torch.manual_seed(0)
    g0 = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))
    d0 = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    batches = _batches(4)
    bce = nn.BCEWithLogitsLoss()

    def d_loss(d, g, real, z):
        n = len(real)
        return bce(d(real), torch.ones(n, 1)) + bce(d(g(z).detach()), torch.zeros(n, 1))

    def g_loss(d, g, z):
        return bce(d(g(z)), torch.ones(len(z), 1))

    g_ref, d_ref = copy.deepcopy(g0), copy.deepcopy(d0)
    opt_g, opt_d = torch.optim.SGD(g_ref.parameters(), lr=0.1), torch.optim.SGD(d_ref.parameters(), lr=0.1)
    for real, z in batches:
        opt_d.zero_grad()
        d_loss(d_ref, g_ref, real, z).backward()
        opt_d.step()
        opt_g.zero_grad()
        g_loss(d_ref, g_ref, z).backward()
        opt_g.step()

    g, d = copy.deepcopy(g0), copy.deepcopy(d0)
    wg = memopt.wrap(g, sample=batches[0], optimizer=torch.optim.SGD(g.parameters(), lr=0.1),
                     training_step=lambda m, b: g_loss(d, m, b[1]), pins={"micro_batch_size": 4}, **KW)
    wd = memopt.wrap(d, sample=batches[0], optimizer=torch.optim.SGD(d.parameters(), lr=0.1),
                     training_step=lambda m, b: d_loss(m, g, b[0], b[1]), pins={"micro_batch_size": 4}, **KW)
    for batch in batches:
        wd.step(batch)
        wg.step(batch)
    _assert_same(d, d_ref)
    _assert_same(g, g_ref)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))


def _labelled(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)]


def _ce(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


def test_the_hand_written_loop_pieces_accumulate_until_their_optimizer_step():
    """backward() twice, then optimizer_step(): the gradients of both add up, as in a loop that accumulates by hand,
    and a step() after it starts from none."""
    batches = _labelled(3)
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches[:2]:
        (F.cross_entropy(ref(x), y) / 2).backward()
    opt.step()
    opt.zero_grad()
    F.cross_entropy(ref(batches[2][0]), batches[2][1]).backward()
    opt.step()

    model = _mlp()
    w = memopt.wrap(model, sample=batches[0], optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_ce,
                    pins={"precision": "fp32"}, **KW)
    for batch in batches[:2]:
        with w.autocast():
            loss = _ce(w.model(batch[0]), batch)
        w.backward(loss / 2)
    w.optimizer_step()
    w.step(batches[2])
    _assert_same(model, ref)


def _unfreezing_run(wrapped: bool, add_group: bool = False) -> nn.Sequential:
    """Fine-tuning's schedule: the first layer frozen for two steps, then trained; the optimizer built over every
    parameter, as the plain loop builds it (SGD skips a parameter without a gradient)."""
    batches = _labelled(4)
    model = _mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = memopt.wrap(model, sample=batches[0], optimizer=opt, loss_fn=_ce, **KW) if wrapped else None
    for i, batch in enumerate(batches):
        if i == 2:
            model[0].requires_grad_(True)
            if add_group:
                w.optimizer.add_param_group({"params": list(model[0].parameters())})
        if w is not None:
            w.step(batch)
        else:
            opt.zero_grad()
            _ce(model(batch[0]), batch).backward()
            opt.step()
    return model


def test_parameters_unfrozen_after_the_wrap_are_refused_until_the_optimizer_holds_them():
    """memopt's optimizer was built over the parameters that required grad at the wrap: one unfrozen later would
    never train (its gradient piling up). The step refuses before it changes anything, naming them and the fix;
    added with wrapped.optimizer.add_param_group, they train as in the plain loop."""
    batches = _labelled(2)
    model = _mlp()
    model[0].requires_grad_(False)
    w = memopt.wrap(model, sample=batches[0], optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_ce,
                    **KW)
    w.step(batches[0])
    model[0].requires_grad_(True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(memopt.InputError, match=r"^2 parameter tensor\(s\) of the model require grad but no param "
                       r"group of wrapped.optimizer holds them \(0.weight, 0.bias: .*add_param_group"):
        w.step(batches[1])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    # frozen again, the step trains as before; a head added after the wrap is found as well
    model[0].requires_grad_(False)
    w.step(batches[1])
    model.append(nn.Linear(5, 5))
    with pytest.raises(memopt.InputError, match=r"\(3.weight, 3.bias: "):
        w.step(batches[1])

    _assert_same(_unfreezing_run(wrapped=True, add_group=True), _unfreezing_run(wrapped=False))


def test_a_step_under_no_grad_plans_and_trains_and_inference_mode_is_refused():
    """A wrap or a first step (which plans) inside torch.no_grad() traces the step with gradients on, as the step
    itself runs; under inference_mode no backward can run, and wrap and step say so in one line."""
    batches = _labelled(3)
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches[1:]:
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    for sample in (batches[0], None):
        model = _mlp()
        with torch.no_grad():
            w = memopt.wrap(model, sample=sample, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            loss_fn=_ce, use_cache=False, **KW)
            for batch in batches[1:]:
                w.step(batch)
        _assert_same(model, ref)
    with torch.inference_mode(), pytest.raises(memopt.InputError, match=r"^wrapped.step was called under "
                                               r"torch.inference_mode\(\).*call it outside inference_mode"):
        w.step(batches[0])
    with torch.inference_mode(), pytest.raises(memopt.InputError, match=r"^memopt.wrap was called under "
                                               r"torch.inference_mode\(\)"):
        memopt.wrap(_mlp(), sample=batches[0], loss_fn=_ce, **KW)


def test_a_learning_rate_written_into_the_passed_optimizer_is_warned_of_once():
    """nanoGPT's loop sets the learning rate of each step into the optimizer it built; memopt trains with its own
    optimizer, built from that one: the first step after a change says where to set it instead, once."""
    batches = _labelled(3)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = memopt.wrap(model, sample=batches[0], optimizer=opt, loss_fn=_ce, **KW)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w.step(batches[0])
        for i, batch in enumerate(batches):
            for group in opt.param_groups:
                group["lr"] = 0.1 / (i + 2)
            w.step(batch)
    said = [str(x.message) for x in seen if "param_groups changed" in str(x.message)]
    assert len(said) == 1 and "set them on wrapped.optimizer.param_groups instead" in said[0], said
    assert "\n" not in said[0]
    assert [Path(x.filename).name for x in seen if "param_groups changed" in str(x.message)] == [Path(__file__).name]
    # set where it trains, it is followed and nothing is said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for group in w.optimizer.param_groups:
            group["lr"] = 0.0
        w.step(batches[0])


def test_a_state_loaded_into_the_passed_optimizer_is_refused_once_and_trains_where_it_is_loaded():
    """The usual resume lines after the wrap, model.load_state_dict(ck["model"]); opt.load_state_dict(ck["optimizer"]):
    memopt trains with its own optimizer, built from opt at the wrap, so the loaded momentum would be ignored. The
    next step refuses in one line before it changes anything; loaded into wrapped.optimizer as it says, the run
    continues as the uninterrupted loop."""
    batches = _labelled(6)

    def sgd(m: nn.Module) -> torch.optim.SGD:
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    ref = _mlp()
    losses_of_plain_loop(ref, batches, lambda m, b: _ce(m(b[0]), b), sgd(ref))
    first = _mlp()
    first_opt = sgd(first)
    losses_of_plain_loop(first, batches[:3], lambda m, b: _ce(m(b[0]), b), first_opt)
    ck = copy.deepcopy({"model": first.state_dict(), "optimizer": first_opt.state_dict()})

    model = _mlp()
    opt = sgd(model)
    w = memopt.wrap(model, sample=batches[0], optimizer=opt, loss_fn=_ce, pins={"precision": "fp32"}, **KW)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(memopt.InputError, match=r"^the optimizer passed to memopt.wrap had a state loaded since the "
                       r"wrap .*load it with wrapped.optimizer.load_state_dict\(...\) instead"):
        w.step(batches[3])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert w.steps_done == 0
    w.optimizer.load_state_dict(ck["optimizer"])
    for batch in batches[3:]:
        w.step(batch)
    _assert_same(model, ref)


def test_steps_of_the_hand_written_loop_are_counted_and_saved(tmp_path):
    """optimizer_step() is an optimizer step as step() is: steps_done counts it and a checkpoint records it, so a
    resume that starts at steps_done takes the batches after those trained on and ends as the uninterrupted loop.
    items_seen counts only the batches step() was given (the hand-written loop's are never seen)."""
    batches = _labelled(4)
    ref = _mlp()
    losses_of_plain_loop(ref, batches, lambda m, b: _ce(m(b[0]), b), torch.optim.SGD(ref.parameters(), lr=0.1))

    model = _mlp()
    w = memopt.wrap(model, sample=batches[0], optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_ce,
                    pins={"precision": "fp32"}, **KW)
    for batch in batches[:2]:
        with w.autocast():
            loss = _ce(w.model(batch[0]), batch)
        w.backward(loss)
        w.optimizer_step()
    assert (w.steps_done, w.items_seen) == (2, 0)
    path = w.save(tmp_path / "ckpt.pt")

    fresh = _mlp()
    resumed = memopt.wrap(fresh, sample=batches[0], optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1),
                          loss_fn=_ce, pins={"precision": "fp32"}, **KW)
    resumed.load(path)
    assert resumed.steps_done == 2
    for batch in batches[resumed.steps_done:]:
        resumed.step(batch)
    assert resumed.steps_done == 4
    _assert_same(fresh, ref)


def _step_lr(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)


def test_a_scheduler_passed_to_wrap_and_still_stepped_by_the_loop_is_warned_of_once(tmp_path):
    """The loop moved onto wrapped.step, lr_scheduler=sched added, and sched.step() left in it: the schedule would run
    twice per step. The step after such a call says so, once, in one line; the loop without it trains as the plain
    one, and a checkpoint loaded at a later position is no step of the script's."""
    batches = _labelled(4)
    ref = _mlp()
    opt, sched = _step_lr(ref)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
        sched.step()

    model = _mlp()
    opt, sched = _step_lr(model)
    w = memopt.wrap(model, sample=batches[0], optimizer=opt, lr_scheduler=sched, loss_fn=_ce, **KW)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in batches:
            w.step(batch)
        later = w.save(tmp_path / "later.pt")
    _assert_same(model, ref)
    assert sched.get_last_lr() == [0.1 * 0.5 ** 4]

    model = _mlp()
    opt, sched = _step_lr(model)
    w = memopt.wrap(model, sample=batches[0], optimizer=opt, lr_scheduler=sched, loss_fn=_ce, **KW)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w.step(batches[0])
        w.load(later)  # the schedule jumps 3 steps ahead: memopt's own doing
        w.step(batches[0])
        assert not [x for x in seen if "lr_scheduler" in str(x.message)]
        for batch in batches:
            w.step(batch)
            sched.step()
    said = [str(x.message) for x in seen if "lr_scheduler" in str(x.message)]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "was also stepped outside it" in said[0] and "stop calling sched.step()" in said[0], said


def test_a_closed_wrapper_refuses_to_step_and_still_saves(tmp_path):
    """close() ends the run (telemetry flushed, calibration stored, OOM recovery released): a step after it is
    refused in one line; the training state can still be saved and the model unwrapped."""
    batches = _labelled(2)
    model = _mlp()
    w = memopt.wrap(model, sample=batches[0], optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_ce,
                    run_dir=tmp_path / "run", **KW)
    w.step(batches[0])
    w.close()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"^this memopt.wrap was closed .* trains no more: call close\(\) after the "
                       r"last step"):
        w.step(batches[1])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert w.save(tmp_path / "ckpt.pt").is_file()
    assert w.unwrap() is model


def test_weights_written_into_a_bf16_master_model_after_the_wrap_are_the_ones_that_train(tmp_path):
    """bf16_master steps fp32 masters and copies them into the bf16 weights after each step. Weights written after
    the wrap (pretrained weights loaded with model.load_state_dict, a best checkpoint restored mid-run) become the
    masters: the run trains as the same weights loaded before the wrap, and a checkpoint or an unwrap before the next
    step holds them; the stale masters used to be copied back over them at the next step."""
    batches = _labelled(3)
    # shifted by 1, so that no element rounds to the bf16 value of the initial weight's
    pretrained = {k: (v + 1.0).bfloat16().float() for k, v in _mlp().state_dict().items()}

    def run(load_after_wrap: bool) -> memopt.Wrapped:
        model = _mlp()
        if not load_after_wrap:
            model.load_state_dict(pretrained)
        w = memopt.wrap(model, sample=batches[0], optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_ce,
                        fidelity="mixed", pins={"precision": "bf16_master"}, **KW)
        if load_after_wrap:
            model.load_state_dict(pretrained)
        return w

    w = run(load_after_wrap=True)
    saved = torch.load(w.save(tmp_path / "ckpt.pt"), weights_only=False)
    assert all(torch.equal(m, v) for m, v in zip(saved["master_weights"]["masters"], pretrained.values()))
    assert all(torch.equal(p, v) for p, v in zip(w.unwrap().parameters(), pretrained.values()))

    after, before = run(load_after_wrap=True), run(load_after_wrap=False)
    for batch in batches:
        assert after.step(batch) == before.step(batch)
    for p, q in zip(after.unwrap().parameters(), before.unwrap().parameters(), strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, q)
