"""prepare() applies the techniques that change the model through the registry, in APPLY_ORDER, and undoes them:
every such technique has its place in the order, each one's change is on the model after prepare, and the undo
gives back the model as it was (its weights keep their trained values)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memopt.step.prepare import APPLY_ORDER, prepare
from memopt.strategy import Checkpointing, Strategy
from memopt.techniques.registry import BY_NAME, model_technique


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h).mean()


def test_every_technique_that_changes_the_model_has_its_place_in_the_order():
    changing = {name for name, t in BY_NAME.items() if callable(getattr(t, "apply", None))}
    assert changing == set(APPLY_ORDER) - {"placement"}
    assert len(APPLY_ORDER) == len(set(APPLY_ORDER))
    # precision casts before anything takes the weights; adapters come after the linears are quantized and placed
    assert APPLY_ORDER.index("precision") == 0
    assert APPLY_ORDER.index("quantization") < APPLY_ORDER.index("placement") < APPLY_ORDER.index("adapters")


def test_a_technique_that_only_changes_the_step_is_not_applied_to_the_model():
    with pytest.raises(ValueError, match="'optimizer' is not a technique that changes the model"):
        model_technique("optimizer")


def test_prepare_applies_each_change_and_the_undo_gives_the_model_back():
    torch.manual_seed(0)
    model = _Blocks()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    strategy = Strategy(precision="bf16_master", checkpointing=Checkpointing(mode="full", num_blocks=2),
                        optimizer="sgd")
    prepared = prepare(model, strategy, device_type="cpu", optimizer_kwargs={"lr": 0.0})
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert ["forward" in b.__dict__ for b in model.blocks] == [False, True, False, True]  # two of four, spread
    # the masters are the weights as given, not their bf16 rounding
    masters = prepared.step.master.masters
    assert all(torch.equal(m, before[n]) for m, (n, _) in zip(masters, model.named_parameters(), strict=True))
    prepared.undo()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not any("forward" in b.__dict__ for b in model.blocks)


def test_checkpointing_a_model_without_repeated_blocks_is_refused_and_nothing_stays_applied():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with pytest.raises(ValueError, match="needs repeated blocks"):
        prepare(model, Strategy(precision="bf16_pure", checkpointing=Checkpointing(mode="full")), device_type="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the precision cast before it was undone


def _checkpointed(model: nn.Module) -> int:
    return sum("forward" in b.__dict__ for b in model.blocks)


def test_undo_keeping_the_device_hands_the_move_home_to_the_next_strategy():
    """Between two strategies the model can stay on the device: the first one's undo removes every technique but
    its placement, whose move home the second takes over, to run once, at its own undo, in the same place."""
    model = _Blocks()
    ran = []
    first = prepare(model, Strategy(checkpointing=Checkpointing(mode="full")), device_type="cpu")
    assert _checkpointed(model) == 4
    first.undo_stack[first.placement] = lambda: ran.append("home")  # what a move from the host would undo
    home = first.undo(keep_on_device=True)
    assert ran == [] and _checkpointed(model) == 0 and first.undo_stack == []  # every technique but placement
    second = prepare(model, Strategy(checkpointing=Checkpointing(mode="full", num_blocks=2)), device_type="cpu")
    second.adopt_placement(home)
    assert _checkpointed(model) == 2
    second.undo()
    assert ran == ["home"] and _checkpointed(model) == 0
    # a plain undo runs the move home itself and keeps nothing; adopting nothing keeps a strategy's own
    third = prepare(model, Strategy(), device_type="cpu")
    third.undo_stack[third.placement] = lambda: ran.append("third")
    third.adopt_placement(None)
    assert third.undo() is None and ran == ["home", "third"]


def test_keeping_the_device_is_refused_where_the_undo_restores_weights_kept_on_the_host():
    from memopt.step.prepare import keeps_placement
    from memopt.techniques.quantization import QuantSetting

    assert keeps_placement(Strategy(precision="bf16_autocast"))
    assert keeps_placement(Strategy(precision="fp32"))
    assert not keeps_placement(Strategy(precision="bf16_master"))
    assert not keeps_placement(Strategy(precision="bf16_pure"))
    assert not keeps_placement(Strategy(precision="bf16_autocast", extras=(("quantization", QuantSetting(bits=4)),)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_model_kept_on_the_gpu_between_strategies_goes_home_once():
    model = _Blocks()
    cuda = torch.device("cuda", torch.cuda.current_device())
    first = prepare(model, Strategy(), device_type="cuda", device=cuda, move_to=cuda)
    home = first.undo(keep_on_device=True)
    assert all(p.device == cuda for p in model.parameters())
    second = prepare(model, Strategy(checkpointing=Checkpointing(mode="full")), device_type="cuda", device=cuda,
                     move_to=cuda)
    second.adopt_placement(home)
    second.undo()
    assert all(p.device.type == "cpu" for p in model.parameters())


def _model_as_it_is(model: nn.Module) -> tuple:
    """What applying a strategy changes on a model: the weights' dtypes, the patched forwards, the hooks."""
    return ({p.dtype for p in model.parameters()}, [sorted(m.__dict__.keys() & {"forward"}) for m in model.modules()],
            sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()))


@pytest.mark.parametrize("interrupt", [RuntimeError, KeyboardInterrupt])
def test_an_interrupt_while_the_plan_is_applied_gives_the_model_back_as_it_was(interrupt):
    """Ctrl-C in a notebook lands anywhere in a slow wrap: a KeyboardInterrupt (a BaseException) is undone as an
    error is, and goes on to the caller."""
    model = _Blocks()
    before = _model_as_it_is(model)

    def interrupted(params):
        raise interrupt("interrupted while the optimizer is built")

    strategy = Strategy(precision="bf16_master", checkpointing=Checkpointing(mode="full"), optimizer="user")
    with pytest.raises(interrupt, match="interrupted"):
        prepare(model, strategy, device_type="cpu", optimizer=interrupted)
    assert _model_as_it_is(model) == before
    assert before[0] == {torch.float32}
