"""What a step finds when it starts, and what it does with it: gradients another model's step left on its parameters
(a GAN), parameters unfrozen since the wrap, a learning rate written on the optimizer the user passed, the caller's
grad mode, a wrapper already closed. Compared with the unwrapped loop, same seed, SGD."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import memopt

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
