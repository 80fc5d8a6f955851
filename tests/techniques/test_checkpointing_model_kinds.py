"""Checkpointing on blocks whose form is not the usual one: layers whose weights torch's ``parametrize`` computes
(each such layer gets a class of its own), and blocks that write into a matmul's output in place, which selective
checkpointing cannot recompute exactly: it is refused for them with the reason, full checkpointing trains."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memopt
from memopt.blocks import find_block_stacks
from tests.reference_loop import losses_of_plain_loop
from tests.zoo.torch_patterns import PATTERNS

_PAT = {p.name: p for p in PATTERNS}


def test_parametrized_layers_of_one_class_are_one_stack() -> None:
    model = _PAT["parametrized_blocks"].build()
    assert len({type(b) for b in model.blocks}) == 4  # what parametrize does: a fresh class per layer
    (stack,) = find_block_stacks(model)
    assert stack.path == "blocks" and len(stack) == 4 and stack.block_class == "Linear" and stack.uniform_tail
    # a parametrized layer beside a plain one of the same class: one kind of block, not interchangeable
    mixed = nn.ModuleList([nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)), nn.Linear(4, 4), nn.Linear(4, 4)])
    (stack,) = find_block_stacks(nn.Sequential(mixed))
    assert len(stack) == 3


def test_a_parametrized_stack_is_checkpointed_exactly() -> None:
    pat = _PAT["parametrized_blocks"]
    g = torch.Generator().manual_seed(2)
    batches = [pat.sample(4, g) for _ in range(3)]

    def run(pins: dict) -> list[float]:
        torch.manual_seed(3)
        w = memopt.wrap(pat.build(), budget="10GB", sample=batches[0], hardware="h200", optimizer="sgd", lr=0.05,
                        guard=False, autotune=False, pins={"precision": "fp32", "micro_batch_size": 4, **pins})
        return [w.step({k: v.clone() for k, v in b.items()}) for b in batches]

    assert run({"checkpointing": "full"}) == pytest.approx(run({"checkpointing": "none"}), rel=1e-6)


def test_selective_is_refused_where_blocks_write_a_matmul_output_in_place() -> None:
    pat = _PAT["inplace_activations"]
    pinned = memopt.plan(pat.build(), pat.sample(4), budget="10GB", hardware="h200",
                         pins={"checkpointing": "selective"})
    said = [n for n in pinned.notes if "cannot be estimated" in n]
    assert len(said) == 1 and "selective checkpointing is refused for this model" in said[0]
    assert "ac=selective" in said[0] and "ac=full" not in said[0]
    assert not pinned.fits and pinned.infeasible["smallest_total_bytes"] is None
    assert pinned.infeasible["message"].startswith("no candidate could be estimated: the model's step fails")
    assert "more GPUs" not in pinned.infeasible["message"]  # not a memory problem
    with pytest.raises(ValueError, match=r"^no strategy can be planned: .*nn.ReLU\(inplace=True\)"):
        memopt.wrap(pat.build(), budget="10GB", sample=pat.sample(4), hardware="h200", guard=False, autotune=False,
                    pins={"checkpointing": "selective"})


def _tiny_llama(own_checkpointing: bool) -> nn.Module:
    from memopt.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny_llama", device="cpu")
    if own_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers 5 renames gradient_checkpointing_enable
def test_a_model_that_checkpoints_itself_is_planned_and_trained_as_the_plan_says() -> None:
    """``model.gradient_checkpointing_enable()`` before ``wrap``: without memopt turning it off, every block would
    recompute whatever the plan says, and the plan would price a model it is not (its "no checkpointing" traced
    with Hugging Face's recomputation inside)."""
    sample = {"input_ids": torch.randint(0, 100, (4, 32)), "labels": torch.randint(0, 100, (4, 32))}
    pins = {"checkpointing": "none", "precision": "fp32"}
    plans = [memopt.plan(_tiny_llama(own), sample, budget="10GB", hardware="h200", use_cache=False, pins=pins)
             for own in (False, True)]
    assert plans[1].prediction["peak_allocated_bytes"] == plans[0].prediction["peak_allocated_bytes"]
    assert plans[1].step_time_s == pytest.approx(plans[0].step_time_s)
    model = _tiny_llama(True)
    w = memopt.wrap(model, budget="10GB", sample=sample, hardware="h200", guard=False, autotune=False, pins=pins,
                    optimizer="sgd", lr=0.05)
    assert not model.is_gradient_checkpointing
    got = w.step(sample)
    w.unwrap()
    assert model.is_gradient_checkpointing  # the user's setting, back
    ref = _tiny_llama(False)
    w_ref = memopt.wrap(ref, budget="10GB", sample=sample, hardware="h200", guard=False, autotune=False, pins=pins,
                        optimizer="sgd", lr=0.05)
    assert got == pytest.approx(w_ref.step(sample), rel=1e-6)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _DictLayers(nn.Module):
    """torchtitan's layout: ``layers`` is an ``nn.ModuleDict`` keyed by layer id, run in order of its values, or read
    by key (``by_key``)."""

    def __init__(self, by_key: bool = False, n: int = 6) -> None:
        super().__init__()
        self.by_key = by_key
        self.layers = nn.ModuleDict({str(i): _Block() for i in range(n)})
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = [self.layers[str(i)] for i in range(len(self.layers))] if self.by_key else self.layers.values()
        for block in blocks:
            x = block(x)
        return self.head(x.mean(1))


@pytest.mark.parametrize("by_key", [False, True], ids=["values", "by_key"])
def test_a_module_dict_of_layers_is_a_stack_checkpointed_exactly_and_estimated_as_simulated(by_key: bool) -> None:
    from memopt.profile.cuda_semantics import kernel_policy_for
    from memopt.profile.simulate import simulate_step
    from memopt.strategy import Checkpointing, Strategy

    (stack,) = find_block_stacks(_DictLayers(by_key))
    assert stack.path == "layers" and len(stack) == 6 and stack.block_class == "_Block"
    # keyed by name (experts, task heads), a dict is what the forward picks from, not layers run in order
    assert find_block_stacks(nn.Sequential(nn.ModuleDict({f"expert_{i}": _Block() for i in range(4)}))) == []
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 12, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(3)]

    def loss_fn(out: torch.Tensor, batch) -> torch.Tensor:
        return nn.functional.cross_entropy(out, batch[1])

    def run(pins: dict) -> list[float]:
        torch.manual_seed(3)
        w = memopt.wrap(_DictLayers(by_key), budget="10GB", sample=batches[0], hardware="h200", optimizer="sgd",
                        lr=0.05, loss_fn=loss_fn, guard=False, autotune=False,
                        pins={"precision": "fp32", "micro_batch_size": 8, **pins})
        return [w.step(b) for b in batches]

    plain = run({"checkpointing": "none"})
    for pins in ({"checkpointing": "full"}, {"checkpointing": "full", "checkpoint_blocks": 2},
                 {"checkpointing": "selective"}):
        assert run(pins) == pytest.approx(plain, rel=1e-6), pins
    # traced at a few blocks (read by key past them: the stack is kept whole) and repeated: the whole step's peak
    model = _DictLayers(by_key)
    prof = memopt.profile(model, batches[0], hardware="h200", loss_fn=loss_fn, use_cache=False)
    s = Strategy(precision="bf16_autocast", checkpointing=Checkpointing(mode="full", num_blocks=3), micro_batch_size=4,
                 grad_accum_steps=2)
    est = memopt.estimate(prof, s, num_steps=3)
    sim = simulate_step(model, lambda d: prof._batch_factory(8, d), s, loss_fn=loss_fn,
                        policy=kernel_policy_for(memopt.load_hardware("h200")), num_steps=3)
    assert est.peak_allocated_bytes == pytest.approx(sim.peak_allocated_bytes, rel=0.005)


class _MixedSequential(nn.Module):
    """``nn.Sequential(input layer, *blocks, norm)`` before a head, run as a whole or read by position (the norm past
    the blocks: the fake copy, which keeps a few blocks, must then hold the container whole)."""

    def __init__(self, n: int = 7, by_index: bool = False) -> None:
        super().__init__()
        self.by_index = by_index
        self.net = nn.Sequential(nn.Linear(16, 16), *[_Block() for _ in range(n)], nn.LayerNorm(16))
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.by_index:  # the norm read by its position, past the blocks
            for i in range(len(self.net) - 1):
                x = self.net[i](x)
            x = self.net[len(self.net) - 1](x)
        else:
            x = self.net(x)
        return self.head(x.mean(1))


def test_a_run_of_blocks_in_a_mixed_container_is_a_stack() -> None:
    """A container that mixes other layers with its blocks holds a stack in each run of two or more blocks of one
    class; a run of single layers, or of stages that hold stacks themselves, is not one."""
    (stack,) = find_block_stacks(_MixedSequential())
    assert stack.path == "net[1:8]" and stack.container_path == "net" and len(stack) == 7
    assert stack.block_name(0) == "net.1" and stack.block_name(6) == "net.7"
    two_runs = nn.Sequential(nn.Linear(16, 16), _Block(), _Block(), nn.LayerNorm(16), _Block(), _Block(), _Block())
    assert [(s.path, len(s)) for s in find_block_stacks(two_runs)] == [("[1:3]", 2), ("[4:7]", 3)]
    layers = nn.Sequential(nn.Embedding(9, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.ReLU())
    assert find_block_stacks(layers) == []
    stages = nn.Sequential(nn.Linear(16, 16), *[nn.Sequential(_Block(), _Block()) for _ in range(3)], nn.ReLU())
    assert [s.path for s in find_block_stacks(stages)] == ["1", "2", "3"]  # each stage is a stack of its blocks


@pytest.mark.parametrize("by_index", [False, True], ids=["in_order", "by_index"])
def test_blocks_in_a_mixed_sequential_are_checkpointed_exactly_and_estimated_as_simulated(by_index: bool) -> None:
    from memopt.profile.cuda_semantics import kernel_policy_for
    from memopt.profile.simulate import simulate_step
    from memopt.strategy import Checkpointing, Strategy

    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 12, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(3)]

    def loss_fn(out: torch.Tensor, batch) -> torch.Tensor:
        return nn.functional.cross_entropy(out, batch[1])

    def run(pins: dict) -> list[float]:
        torch.manual_seed(3)
        w = memopt.wrap(_MixedSequential(by_index=by_index), budget="10GB", sample=batches[0], hardware="h200",
                        optimizer="sgd", lr=0.05, loss_fn=loss_fn, guard=False, autotune=False, use_cache=False,
                        pins={"precision": "fp32", "micro_batch_size": 8, **pins})
        if pins["checkpointing"] != "none":
            assert w.plan.strategy.checkpointing.mode == pins["checkpointing"]
        return [w.step(b) for b in batches]

    plain = run({"checkpointing": "none"})
    for pins in ({"checkpointing": "full", "checkpoint_blocks": 7}, {"checkpointing": "full", "checkpoint_blocks": 3},
                 {"checkpointing": "selective"}):
        assert run(pins) == pytest.approx(plain, rel=1e-6), pins
    # a run is traced whole (cutting it would renumber the layers after it): the whole step's peak
    model = _MixedSequential(by_index=by_index)
    prof = memopt.profile(model, batches[0], hardware="h200", loss_fn=loss_fn, use_cache=False)
    assert prof.full_block_counts == [7]
    s = Strategy(precision="bf16_autocast", checkpointing=Checkpointing(mode="full", num_blocks=3), micro_batch_size=4,
                 grad_accum_steps=2)
    est = memopt.estimate(prof, s, num_steps=3)
    sim = simulate_step(model, lambda d: prof._batch_factory(8, d), s, loss_fn=loss_fn,
                        policy=kernel_policy_for(memopt.load_hardware("h200")), num_steps=3)
    assert est.peak_allocated_bytes == pytest.approx(sim.peak_allocated_bytes, rel=0.005)


class _ScriptedBlocks(nn.Module):
    """Blocks compiled with ``torch.jit.script``: they take no hooks (checkpointing's, the trace's markers')."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([torch.jit.script(_Block()) for _ in range(3)])
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(1))


def test_scripted_blocks_are_planned_and_trained_without_checkpointing() -> None:
    """Planned (their stack is not one) and trained exactly: the fake trace, which shares a scripted module with
    the model, leaves no fake gradient in the model's parameters for the first step to add to."""
    assert find_block_stacks(_ScriptedBlocks()) == []
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 12, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(3)]

    def loss_fn(out: torch.Tensor, batch) -> torch.Tensor:
        return nn.functional.cross_entropy(out, batch[1])

    torch.manual_seed(3)
    model = _ScriptedBlocks()
    ref = _ScriptedBlocks()
    ref.load_state_dict(model.state_dict())
    w = memopt.wrap(model, budget="10GB", sample=batches[0], hardware="h200", optimizer="sgd", lr=0.05,
                    loss_fn=loss_fn, guard=False, autotune=False, use_cache=False,
                    pins={"precision": "fp32", "micro_batch_size": 4})
    assert w.plan.strategy.checkpointing.mode == "none"
    assert any("layers: its blocks are torch.jit.script-ed" in n for n in w.plan.notes)
    # the trace shares a scripted module with the model (it cannot be copied): it must leave no gradient behind
    assert all(p.grad is None for p in model.parameters())
    got = [w.step(b) for b in batches]
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)  # memopt's "sgd"
    want = losses_of_plain_loop(ref, batches, lambda m, b: loss_fn(m(b[0]), b), opt)
    assert got == pytest.approx(want, rel=1e-5)
