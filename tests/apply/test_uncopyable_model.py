"""A model that holds something that cannot be copied (an open file, a hook bound to an object holding one) is
traced and trained: the trace copies the module tree, not every attribute (it raised "memopt could not copy the
model for tracing (TypeError: cannot pickle 'TextIOWrapper' ...)" on QLoRA plans of a model with weights)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.models import build_model, with_overrides


class Logger:
    """Holds an open file; its bound method is a forward hook on the model."""

    def __init__(self, path) -> None:
        self.file = open(path, "w")  # noqa: SIM115 - kept open on purpose: this is what cannot be copied
        self.calls = 0

    def hook(self, module, args, output) -> None:
        self.calls += 1


class Net(nn.Module):
    def __init__(self, log_path) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.head = nn.Linear(16, 3)
        self.log = open(log_path, "a")  # noqa: SIM115

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def test_a_model_holding_an_open_file_is_traced_and_trains_exactly(tmp_path):
    torch.manual_seed(0)
    model = Net(tmp_path / "log.txt")
    logger = Logger(tmp_path / "hook.txt")
    model.layers[0].register_forward_hook(logger.hook)
    with pytest.raises(TypeError):
        copy.deepcopy(model)  # what tracing used to do
    ref = Net(tmp_path / "ref.txt")
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    wrapped = memopt.wrap(model, budget="4GB", sample=batches[0], hardware="h100_80gb", device="cpu",
                          use_cache=False, loss_fn=lambda out, b: F.cross_entropy(out, b[1]),
                          pins={"micro_batch_size": 4, "precision": "fp32"},
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    calls_after_planning = logger.calls
    got = [wrapped.step(b) for b in batches]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for x, y in batches:
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(loss.detach()))
    assert got == pytest.approx(want, rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    # the user's hook runs on the real model: 2 micro-batches a step, and the first split batch's four forwards that
    # measure how the loss reduces over samples (memopt.step.loss_reduction: half the micro-batch once and twice,
    # its other half, and the whole micro-batch)
    assert logger.calls == calls_after_planning + 2 * 3 + 4
    assert not model.log.closed and model.log is not None


def test_qlora_plan_of_a_model_with_weights_and_an_open_file(tmp_path):
    """The issue's case: fidelity='qlora' traces quantized variants of a model built with its weights."""
    spec = with_overrides("tiny_llama", {"num_hidden_layers": 2})
    model = build_model(spec, device="cpu")
    model.log = open(tmp_path / "train.log", "w")  # noqa: SIM115
    plan = memopt.plan(model, {"batch_size": 2, "seq_len": 16}, budget="8GiB", hardware="h100_80gb",
                       fidelity="qlora", pins={"quant_bits": 4, "adapter_rank": 8}, use_cache=False)
    assert plan.fits
    assert plan.strategy.extra("quantization") is not None and plan.strategy.extra("adapters") is not None
