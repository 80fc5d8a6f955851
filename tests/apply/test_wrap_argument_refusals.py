"""memopt.wrap refuses, in one line before it plans or touches the model, what it would otherwise ignore or run
wrongly: a saved plan= with arguments that would plan otherwise (or that does not fit), optimizer hyper-parameters the
optimizer does not take, a max_grad_norm that is not a positive number; and gradients left on the model before wrap
do not leak into the first step."""

from __future__ import annotations

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
