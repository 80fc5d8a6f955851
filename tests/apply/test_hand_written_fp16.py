"""The pieces of a hand-written loop under an fp16 plan (``wrapped.backward``, ``wrapped.optimizer_step``): the
gradients between them are the true ones, as after torch's ``scaler.unscale_``, so the loop's own clipping and
grad-norm log are the AMP recipe's without a scaler of its own. Compared with torch's GradScaler loop, same seed,
on the CPU's fp16 autocast: identical, an overflowing step skipped by both, accumulation by hand included."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import memopt

KW = {"budget": "4GB", "hardware": "h100_80gb", "device": "cpu"}
MAX_NORM = 0.5
BLOW_UP = 1e30  # one micro-batch's loss times this overflows its fp16 gradients: the step is skipped


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))


def _steps() -> list[list[tuple[torch.Tensor, torch.Tensor, float]]]:
    """Each optimizer step's micro-batches with the factor on their loss: one, then two accumulated by hand, then
    one that overflows, then one again."""
    g = torch.Generator().manual_seed(1)

    def mb(factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, float]:
        return torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g), factor

    return [[mb()], [mb(0.5), mb(0.5)], [mb(0.5), mb(0.5 * BLOW_UP)], [mb()]]


def _ce(out: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


def _torch_amp_loop() -> tuple[nn.Module, list[float], float]:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    norms = []
    for step in _steps():
        opt.zero_grad(set_to_none=True)
        for x, y, factor in step:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y) * factor
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        scaler.step(opt)
        scaler.update()
    return model, norms, scaler.get_scale()


def test_the_gradients_a_hand_written_fp16_loop_clips_are_unscaled_as_in_torchs_amp_loop():
    ref, ref_norms, ref_scale = _torch_amp_loop()

    model = _mlp()
    steps = _steps()
    w = memopt.wrap(model, sample=steps[0][0][:2], optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    loss_fn=_ce, fidelity="mixed", pins={"precision": "fp16_autocast"}, **KW)
    norms = []
    for step in steps:
        for x, y, factor in step:
            with w.autocast():
                loss = F.cross_entropy(w.model(x), y) * factor
            w.backward(loss)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        w.optimizer_step()

    assert norms[0] == ref_norms[0] and 0.1 < norms[0] < 10, norms  # the true norm, not 65536 times it
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=0, atol=0, equal_nan=True)
    assert w.state_dict()["grad_scaler"]["scale"] == ref_scale == 65536.0 / 2  # the overflow backed the scale off
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_step_after_an_abandoned_hand_written_fp16_backward_unscales_its_own_gradients():
    """A backward whose step the loop abandoned (no optimizer_step), then step(batch): the step starts from no
    gradient, and unscales the ones it accumulates itself, as torch's loop after zero_grad would."""
    steps = _steps()
    x, y, _ = steps[0][0]
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(ref(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()

    model = _mlp()
    w = memopt.wrap(model, sample=(x, y), optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_ce,
                    fidelity="mixed", pins={"precision": "fp16_autocast", "micro_batch_size": 8}, **KW)
    x2, y2, _ = steps[1][0]
    with w.autocast():
        w.backward(F.cross_entropy(w.model(x2), y2))
    w.step((x, y))
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name
