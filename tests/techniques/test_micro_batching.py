"""Micro-batching a model with BatchNorm is not exact (its statistics come from the micro-batch): the planner refuses
it, with the reason in the plan, honours a pinned micro-batch (and ``memopt.wrap`` warns), and a Trainer script that
already accumulates keeps its own micro-batch."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import memopt
from memopt.step.prepare import prepare
from memopt.strategy import Strategy
from memopt.techniques.micro_batching import micro_batch_refusal


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _batch(n: int = 8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _loss(out, batch):
    return nn.functional.cross_entropy(out, batch[1])


def test_micro_batches_change_a_batchnorm_models_training():
    """Why the refusal: the same step over 8 samples and over 4 + 4 gives other gradients."""
    losses = {}
    for mb in (8, 4):
        torch.manual_seed(0)
        model = ConvBN()
        prepared = prepare(model, Strategy(micro_batch_size=mb, grad_accum_steps=8 // mb, optimizer="sgd"),
                           device_type="cpu", loss_fn=_loss, optimizer_kwargs={"lr": 0.1})
        prepared.step.step(_batch())
        losses[mb] = [p.detach().clone() for p in model.parameters()]
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(losses[8], losses[4], strict=True))
    assert micro_batch_refusal(ConvBN())
    assert micro_batch_refusal(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))) is None


def test_the_planner_refuses_micro_batches_for_batchnorm_and_says_why():
    plan = memopt.plan(ConvBN(), _batch(), budget="8GB", hardware="h200", loss_fn=_loss, pins={"precision": "fp32"},
                       use_cache=False)
    assert plan.strategy.micro_batch_size == 8
    assert any("micro-batching refused" in n and "BatchNorm" in n for n in plan.notes)
    assert all(r["label"].split(" mb=")[1].startswith("8x1") for r in plan.runners_up)


def test_a_pinned_micro_batch_is_the_users_call_and_wrap_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = memopt.wrap(ConvBN(), budget="8GB", hardware="h200", sample=_batch(), loss_fn=_loss,
                              pins={"micro_batch_size": 2}, use_cache=False)
    assert wrapped.plan.strategy.micro_batch_size == 2
    assert any("BatchNorm" in str(w.message) for w in caught)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_trainer_that_accumulates_keeps_its_own_micro_batch(tmp_path, accumulation):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3))
    g = torch.Generator().manual_seed(1)
    data = [{"pixel_values": torch.randn(3, 32, 32, generator=g), "labels": torch.randint(0, 3, (), generator=g)}
            for _ in range(16)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8 // accumulation,
        gradient_accumulation_steps=accumulation, max_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        logging_strategy="no", disable_tqdm=True)
    trainer = memopt.wrap(transformers.Trainer(model=model, args=args, train_dataset=data), budget="8GB",
                          hardware="h200", pins={"precision": "fp32"})
    plan = trainer.memopt_plan
    assert plan.global_batch == 8 and plan.strategy.micro_batch_size == 8 // accumulation


class PooledBN(nn.Module):
    """A BatchNorm1d over pooled features (one value per channel of each sample), as classifier heads have."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x).mean((2, 3))))


def test_a_micro_batch_too_small_for_batchnorm_is_refused_naming_the_layer():
    """One sample per micro-batch gives the BatchNorm1d one value per channel (torch refuses to train on it): the
    plan says which layer and why, instead of torch's anonymous error from inside the trace."""
    plan = memopt.plan(PooledBN(), _batch(4), budget="8GB", hardware="h200", loss_fn=_loss,
                       pins={"precision": "fp32"}, use_cache=False)
    assert plan.strategy.micro_batch_size == 4  # unpinned: the whole batch, as for any BatchNorm model
    with pytest.raises(ValueError, match=r"micro-batch of 1 sample cannot train this model: its BatchNorm layer bn "
                                         r"gets an input of shape \(1, 8\)"):
        memopt.plan(PooledBN(), _batch(4), budget="8GB", hardware="h200", loss_fn=_loss,
                    pins={"precision": "fp32", "micro_batch_size": 1}, use_cache=False)
    with pytest.raises(ValueError, match="each micro-batch needs at least 2 samples"):
        memopt.plan(PooledBN(), _batch(1), budget="8GB", hardware="h200", loss_fn=_loss,
                    pins={"precision": "fp32"}, use_cache=False)


class _WideMLP(nn.Module):
    """Activations dominate a 1.5 GB budget at 64 samples of (128, 512): only micro-batches fit."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
                                    for _ in range(4))
        self.head = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(1))


def _clip_in_backward(p: torch.Tensor) -> None:
    """Per-parameter norm clip as soon as the gradient is accumulated: not linear in the gradient."""
    n = p.grad.norm()
    if n > 0.05:
        p.grad.mul_(0.05 / n)


def _ce(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(out, batch[1])


def test_post_accumulate_grad_hooks_refuse_micro_batching_and_train_as_the_plain_loop() -> None:
    """A post-accumulate hook sees .grad after each backward: on a micro-batch's partial sum it would clip (or step)
    once per micro-batch. The plan keeps the batch whole, and training is the plain loop's."""
    model = _WideMLP()
    model.head.weight.register_post_accumulate_grad_hook(_clip_in_backward)
    assert "post-accumulate-grad hooks" in micro_batch_refusal(model)
    x, y = torch.randn(64, 128, 512), torch.randint(0, 10, (64,))
    plan = memopt.make_plan(model, (x, y), budget="1.5GB", hardware="h100_80gb", loss_fn=_ce, use_cache=False)
    assert plan.strategy.micro_batch_size == 64
    assert any("post-accumulate-grad hooks" in n and "head.weight" in n for n in plan.notes)

    small, ref = (nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)) for _ in range(2))
    ref.load_state_dict(small.state_dict())
    for p, q in zip(small.parameters(), ref.parameters()):
        p.register_post_accumulate_grad_hook(_clip_in_backward)
        q.register_post_accumulate_grad_hook(_clip_in_backward)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    w = memopt.wrap(small, budget="4GB", sample=batches[0], hardware="h100_80gb", device="cpu", use_cache=False,
                    guard=False, optimizer=torch.optim.SGD(small.parameters(), lr=0.5), loss_fn=_ce,
                    pins={"precision": "fp32"})
    for b in batches:
        _ce(ref(b[0]), b).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        w.step(b)
    for p, q in zip(small.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_gradient_hooks_on_parameters_are_noted() -> None:
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    model[2].weight.register_hook(lambda grad: grad * 10)
    prof = memopt.profile(model, (torch.randn(8, 6), torch.randint(0, 3, (8,))), hardware="h100_80gb", loss_fn=_ce,
                          use_cache=False)
    assert any("2.weight" in n and "gradient hooks (register_hook)" in n for n in prof.notes)
