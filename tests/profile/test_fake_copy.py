"""fake_copy takes no real memory and never fails on what a trained model carries besides its tensors."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memopt.profile.fake_model import fake_copy
from memopt.profile.tracker import MemoryTracker
from memopt.units import allocator_size


class _StateHolder:
    """What a guard or trainer hangs on a model through a hook: an object that reaches the optimizer's states."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def hook(self, module: nn.Module, args: tuple) -> None:
        return None


def _trained_model(tmp_path) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    holder = _StateHolder(opt)
    model.register_forward_pre_hook(holder.hook)
    model.log_file = open(tmp_path / "log.txt", "w")  # noqa: SIM115 - a user's attribute that cannot be pickled
    model.scale = torch.full((256,), 2.0)  # a plain tensor attribute, neither parameter nor buffer
    return model, opt


def test_copy_allocates_nothing_real_whatever_hooks_reach(tmp_path):
    model, opt = _trained_model(tmp_path)
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                      if isinstance(t, torch.Tensor))
    assert state_bytes > 500_000  # the AdamW moments a deep copy through the hook would duplicate
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracker = MemoryTracker("cpu")
    with tracker:
        clone = fake_copy(model, mode, "cpu")
    # the tracker sees fake allocations too: the clone's own tensors, and nothing of the optimizer's states
    own = sum(allocator_size(t.numel() * t.element_size()) for t in [*model.parameters(), model.scale])
    assert tracker.peak_bytes == own
    assert all(isinstance(p, FakeTensor) for p in clone.parameters())
    assert isinstance(clone.scale, FakeTensor) and clone.scale.shape == (256,)
    assert clone.log_file is model.log_file  # shared, not copied
    model.log_file.close()


def test_clone_hooks_are_its_own(tmp_path):
    model, _ = _trained_model(tmp_path)
    clone = fake_copy(model, FakeTensorMode(allow_non_fake_inputs=True), "cpu")
    before = len(model._forward_hooks)
    clone.register_forward_hook(lambda m, a, o: None)
    assert len(model._forward_hooks) == before
    assert len(clone._forward_pre_hooks) == len(model._forward_pre_hooks) == 1
    model.log_file.close()


def test_clone_runs_and_references_only_clones():
    torch.manual_seed(0)
    inner = nn.Linear(8, 8)

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = inner
            self.b = nn.Linear(8, 8)
            self.b.weight = inner.weight  # tied
            self.route = [self.a, self.b]  # modules in a plain list
            self.call_a = self.a.forward  # a bound method of a submodule

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.route[1](self.call_a(x))

    model = Shared()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    clone = fake_copy(model, mode, "cpu")
    assert clone.route[0] is clone.a and clone.route[1] is clone.b
    assert clone.call_a.__self__ is clone.a
    assert clone.b.weight is clone.a.weight
    with mode:
        out = clone(torch.empty(2, 8))
    assert isinstance(out, FakeTensor) and out.shape == (2, 8)


class _Stack(nn.Module):
    """Eight interchangeable blocks, read in order (``indexed``: by position, as MarkupLM reads its per-depth
    embeddings with ``for i in range(config.max_depth)``)."""

    def __init__(self, indexed: bool) -> None:
        super().__init__()
        self.indexed = indexed
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(8))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.indexed:
            for i in range(8):
                x = torch.relu(self.layers[i](x))
        else:
            for layer in self.layers:
                x = torch.relu(layer(x))
        return self.head(x)


def test_a_stack_read_by_position_is_traced_whole_with_the_same_estimate():
    """The trace keeps a few blocks of a stack; a model that reads block 5 by position would hit the end of the
    truncated list (an IndexError from inside the trace): that stack is traced whole instead, and the plan
    predicts what it predicts for the same model reading its blocks in order."""
    import memopt

    def loss(out, batch):
        return nn.functional.cross_entropy(out, batch[1])

    batch = (torch.randn(8, 64), torch.randint(0, 4, (8,)))
    plans = [memopt.plan(_Stack(indexed), batch, budget="8GB", hardware="h200", loss_fn=loss,
                         pins={"precision": "fp32", "micro_batch_size": 8, "checkpointing": "none"}, use_cache=False)
             for indexed in (False, True)]
    assert plans[1].strategy == plans[0].strategy
    assert plans[1].peak_allocated_bytes == plans[0].peak_allocated_bytes > 0
