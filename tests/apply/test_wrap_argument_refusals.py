"""memopt.wrap refuses, in one line before it plans or touches the model, what it would otherwise ignore or run
wrongly: a saved plan= with arguments that would plan otherwise (or that does not fit), optimizer hyper-parameters the
optimizer does not take, a max_grad_norm that is not a positive number; and gradients left on the model before wrap
do not leak into the first step."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import memopt
from memopt.models import build_model

SAMPLE = {"batch_size": 4, "seq_len": 32}


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (4, 32), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _model():
    torch.manual_seed(0)
    return build_model("tiny_llama", device="cpu")


def test_a_saved_plan_refuses_arguments_that_would_plan_otherwise():
    plan = memopt.plan("tiny_llama", SAMPLE, budget="4GB", hardware="h100_80gb", pins={"precision": "fp32"})
    model = _model()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for given, named in (({"budget": "1GB"}, "budget='1GB' (the plan's is 3.73 GiB)"),
                         ({"optimizer": "sgd"}, f"optimizer='sgd' (the plan's is '{plan.strategy.optimizer}')"),
                         ({"pins": {"micro_batch_size": 2}}, "pins={'micro_batch_size': 2}"),
                         ({"fidelity": "lossy"}, "fidelity='lossy'")):
        with pytest.raises(ValueError, match="^a saved plan= is applied as it was made, but " + re.escape(named)
                           + " would plan otherwise"):
            memopt.wrap(model, plan=plan, **given)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    # the plan's own budget, and 'adamw' (the optimizer default), are what it was made with
    memopt.wrap(_model(), plan=plan, budget="4GB", optimizer="adamw").close()


def test_a_saved_plan_that_does_not_fit_is_not_applied():
    unfit = memopt.plan("tiny_llama", {"batch_size": 64, "seq_len": 1024}, budget="1GB", hardware="h100_80gb",
                        pins={"offload": False})
    assert not unfit.fits
    with pytest.raises(ValueError, match=r"^the saved plan does not fit its budget"):
        memopt.wrap(_model(), plan=unfit)


def test_a_saved_plan_refuses_a_sample_larger_per_sample_than_its_own():
    """Longer sequences need more activation memory than the plan predicts: refused at wrap, as another batch
    size is, unless allow_plan_mismatch=True."""
    plan = memopt.plan("tiny_llama", SAMPLE, budget="4GB", hardware="h100_80gb")
    for sample, named in (({"batch_size": 4, "seq_len": 128}, "seq_len=128 (planned 32)"),
                          ({"input_ids": torch.zeros(4, 64, dtype=torch.long)},
                           "input_ids (4, 64) (planned per sample (32,))")):
        with pytest.raises(ValueError, match=r"^the sample is larger per sample than the saved plan's: "
                           + re.escape(named)):
            memopt.wrap(_model(), plan=plan, sample=sample)
    memopt.wrap(_model(), plan=plan, sample={"batch_size": 4, "seq_len": 16}).close()  # shorter: within the plan
    memopt.wrap(_model(), plan=plan, sample={"batch_size": 4, "seq_len": 128}, allow_plan_mismatch=True).close()


def test_a_saved_plan_refuses_a_batch_of_another_size_whatever_its_structure():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    loss_fn = lambda out, b: torch.nn.functional.cross_entropy(out, b[1])  # noqa: E731
    plan = memopt.plan(model, (torch.randn(8, 16), torch.randint(0, 4, (8,))), budget="4GB",
                       hardware="h100_80gb", loss_fn=loss_fn)
    for sample in ((torch.randn(32, 16), torch.randint(0, 4, (32,))), [torch.randn(32, 16), torch.zeros(32)],
                   {"x": torch.randn(32, 16)}, torch.randn(32, 16)):
        with pytest.raises(ValueError, match=r"^the saved plan is for a global batch of 8, the sample has "
                           r"batch_size=32"):
            memopt.wrap(model, plan=plan, sample=sample, loss_fn=loss_fn)
    x2 = (torch.randn(8, 32), torch.randint(0, 4, (8,)))  # wider per sample than planned
    with pytest.raises(ValueError, match=re.escape("[0] (8, 32) (planned per sample (16,))")):
        memopt.wrap(model, plan=plan, sample=x2, loss_fn=loss_fn)
    memopt.wrap(model, plan=plan, sample=(torch.randn(32, 16), torch.randint(0, 4, (32,))), loss_fn=loss_fn,
                allow_plan_mismatch=True).close()


@pytest.mark.parametrize(("optimizer", "kwargs", "message"), [
    ("adamw", {"nesterov": True}, r"optimizer_kwargs: AdamW takes no argument 'nesterov'; it takes amsgrad, betas"),
    ("sgd", {"betas": (0.9, 0.99)}, r"SGD takes no argument 'betas'"),
    ("adamw", {"lrr": 0.1}, r"AdamW takes no argument 'lrr' \(did you mean 'lr'\?\)"),
])
def test_a_hyperparameter_the_optimizer_does_not_take_is_refused_before_planning(optimizer, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("optimizer_kwargs: ", "")):
        memopt.wrap(_model(), budget="4GB", sample=SAMPLE, hardware="h100_80gb", optimizer=optimizer,
                    optimizer_kwargs=kwargs)


@pytest.mark.parametrize("norm", [-1.0, 0, float("nan"), "1"])
def test_max_grad_norm_must_be_a_positive_number(norm):
    with pytest.raises(ValueError, match=r"max_grad_norm=.* must be a finite number > 0, e.g. max_grad_norm=1.0"):
        memopt.wrap(_model(), budget="4GB", sample=SAMPLE, hardware="h100_80gb", max_grad_norm=norm)


def test_gradients_left_on_the_model_before_wrap_are_not_in_the_first_step():
    pins = {"precision": "fp32", "optimizer": "sgd"}
    clean = memopt.wrap(_model(), budget="4GB", sample=SAMPLE, hardware="h100_80gb", pins=pins, lr=0.1)
    clean.step(_batch(0))
    dirty_model = _model()
    dirty_model(**_batch(5)).loss.backward()  # a sanity check the user ran before wrapping
    dirty = memopt.wrap(dirty_model, budget="4GB", sample=SAMPLE, hardware="h100_80gb", pins=pins, lr=0.1)
    dirty.step(_batch(0))
    for name, value in clean.model.named_parameters():
        torch.testing.assert_close(dirty.model.get_parameter(name), value, rtol=0, atol=0)


def test_a_wrapped_model_is_not_wrapped_again_until_unwrapped():
    model = _model()
    first = memopt.wrap(model, budget="4GB", sample=SAMPLE, hardware="h100_80gb", fidelity="mixed",
                        pins={"precision": "bf16_master"})
    with pytest.raises(ValueError, match=r"^this model is already wrapped by memopt.wrap: .* unwrap\(\) first"):
        memopt.wrap(model, budget="4GB", sample=SAMPLE, hardware="h100_80gb")
    memopt.wrap(first.unwrap(), budget="4GB", sample=SAMPLE, hardware="h100_80gb").close()


def test_a_failed_wrap_leaves_the_model_free_to_wrap_again():
    model = _model()
    with pytest.raises(ValueError):
        memopt.wrap(model, budget="4GB", sample=SAMPLE, hardware="h100_80gb", pins={"checkpoint_blocks": 99})
    memopt.wrap(model, budget="4GB", sample=SAMPLE, hardware="h100_80gb").close()


@pytest.mark.parametrize(("content", "message"), [
    ("[1, 2]", r"holds a JSON list, not a memopt plan"),
    (None, r"is a directory: pass the plan's JSON file"),
])
def test_a_plan_path_that_holds_no_plan_is_refused_in_one_line(tmp_path, content, message):
    path = tmp_path / "plan.json"
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        memopt.wrap(_model(), plan=str(path))


@pytest.mark.parametrize(("device", "message"), [
    ("tpu", r"device='tpu' is not a torch device|device='tpu': memopt trains on a CUDA GPU or the CPU"),
    ("cuda", r"device='cuda', but no CUDA GPU is visible: use device='cpu'"),
])
def test_a_device_memopt_cannot_train_on_is_refused(device, message):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ValueError, match=message):
        memopt.wrap(_model(), budget="4GB", sample=SAMPLE, hardware="h100_80gb", device=device)


def test_a_step_inside_no_grad_still_trains():
    pins = {"precision": "fp32", "optimizer": "sgd"}
    plain = memopt.wrap(_model(), budget="4GB", sample=SAMPLE, hardware="h100_80gb", pins=pins, lr=0.1)
    plain.step(_batch(0))
    quiet = memopt.wrap(_model(), budget="4GB", sample=SAMPLE, hardware="h100_80gb", pins=pins, lr=0.1)
    with torch.no_grad():
        quiet.step(_batch(0))
    for name, value in plain.model.named_parameters():
        torch.testing.assert_close(quiet.model.get_parameter(name), value, rtol=0, atol=0)


def test_an_optimizer_or_schedule_callable_that_builds_something_else_is_refused():
    """The user's callable is wrong for every plan: one input error naming it, from wrap and from plan (the planner
    does not take it for candidates that cannot run and report that nothing fits)."""
    other = torch.nn.Linear(2, 2)
    for optimizer, message in ((lambda params: "adamw", r"^optimizer= returned a str, not an optimizer"),
                               (lambda params: torch.optim.SGD(other.parameters(), lr=0.1),
                                r"^the optimizer optimizer= built holds 2 tensor\(s\) other than the parameters it "
                                r"was given")):
        with pytest.raises(memopt.InputError, match=message) as caught:
            memopt.wrap(_model(), budget="4GB", sample=SAMPLE, hardware="h100_80gb", optimizer=optimizer)
        assert caught.value.__cause__ is None and caught.value.__context__ is None
        with pytest.raises(memopt.InputError, match=message):
            memopt.plan(_model(), SAMPLE, budget="4GB", hardware="h100_80gb", optimizer=optimizer)
    with pytest.raises(ValueError, match=r"lr_scheduler= returned a float, not a learning-rate scheduler"):
        memopt.wrap(_model(), budget="4GB", sample=SAMPLE, hardware="h100_80gb", lr_scheduler=lambda opt: 0.5)


def test_a_run_dir_that_is_a_file_and_a_state_that_is_no_checkpoint_are_refused(tmp_path):
    blocker = tmp_path / "telemetry"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"run_dir=.* is a file: give a folder"):
        memopt.wrap(_model(), budget="4GB", sample=SAMPLE, hardware="h100_80gb", run_dir=blocker)
    wrapped = memopt.wrap(_model(), budget="4GB", sample=SAMPLE, hardware="h100_80gb")
    before = {k: v.clone() for k, v in wrapped.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"this is not a memopt checkpoint \(it has no 'model' or 'optimizer'\)"):
        wrapped.load_state_dict({})
    assert all(torch.equal(v, before[k]) for k, v in wrapped.model.state_dict().items())


def test_a_scheduler_that_is_not_callable_and_an_empty_sample_are_refused_in_one_line():
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    kw = {"budget": "16GB", "hardware": "h100_80gb",
          "loss_fn": lambda out, b: torch.nn.functional.cross_entropy(out, b[1])}
    with pytest.raises(ValueError, match=r"lr_scheduler=5 is not callable: pass a callable optimizer -> scheduler"):
        memopt.wrap(torch.nn.Linear(16, 4), sample=(x, y), lr_scheduler=5, **kw)
    with pytest.raises(ValueError, match=r"sample: the batch holds no samples \(its tensors have 0 rows"):
        memopt.wrap(torch.nn.Linear(16, 4), sample=(x[:0], y[:0]), **kw)
    w = memopt.wrap(torch.nn.Linear(16, 4), sample=(x, y), guard=False, **kw)
    with pytest.raises(ValueError, match=r"the batch holds no samples"):
        w.step((x[:0], y[:0]))
    assert w.steps_done == 0


def test_a_model_compiled_in_place_is_refused_as_torch_compile_is():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    model[0].compile()  # nn.Module.compile(): the block's calls run compiled, in place
    with pytest.raises(ValueError, match=r"does not support torch.compile'd models"):
        memopt.wrap(model, budget="16GB", hardware="h100_80gb", sample=torch.randn(8, 16),
                    loss_fn=lambda out, b: out.pow(2).mean())


def test_a_model_with_uninitialised_lazy_modules_is_refused_until_one_forward_initialises_them():
    class Lazy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = torch.nn.LazyLinear(32), torch.nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.l2(torch.relu(self.l1(x)))

    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    kw = {"budget": "4GB", "hardware": "h100_80gb",
          "loss_fn": lambda out, b: torch.nn.functional.cross_entropy(out, b[1])}
    message = (r"^the model has lazy modules a forward has not initialised yet \(l1 \(LazyLinear\)\).* run one forward "
               r"on a real batch first \(model\(batch\)\)")
    torch.manual_seed(0)
    model = Lazy()
    for call in (lambda: memopt.wrap(model, sample=(x, y), **kw), lambda: memopt.wrap(model, **kw),
                 lambda: memopt.plan(model, (x, y), **kw), lambda: memopt.profile(model, (x, y), hardware="h100_80gb")):
        with pytest.raises(memopt.InputError, match=message):
            call()
    model(x)  # the fix the message names; the model then trains as the unwrapped loop
    ref = copy.deepcopy(model)
    w = memopt.wrap(model, sample=(x, y), guard=False, device="cpu", pins={"precision": "fp32"},
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1), **kw)
    w.step((x, y))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
