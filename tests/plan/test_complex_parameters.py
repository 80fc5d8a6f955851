"""A model with complex parameters (a Fourier neural operator's spectral weights): the optimizers that step only
real floating-point parameters are refused for it with the reason, one that takes the same update is planned in
the fused AdamW's place, and a pin of a refused one is a one-line error, never a traceback from inside torch."""

import pytest
import torch
from torch import nn

import memopt
from memopt.errors import InputError
from tests.zoo.torch_patterns import SpectralNet

BATCH = {"x": torch.randn(8, 6, 16), "labels": torch.randint(0, 4, (8,))}


def test_fused_adamw_is_refused_and_the_foreach_update_planned():
    plan = memopt.plan(SpectralNet(), BATCH, budget="8GB", hardware="h200", use_cache=False)
    assert plan.fits and plan.strategy.optimizer == "adamw_foreach"
    refused = [n for n in plan.notes if n.startswith("optimizer adamw_fused refused")]
    assert len(refused) == 1 and "complex64" in refused[0] and "adamw_foreach" in refused[0]


def test_eight_bit_states_are_refused_for_complex_parameters():
    """bitsandbytes would cast the complex gradient to float (dropping its imaginary part): refused, not planned."""
    plan = memopt.plan(SpectralNet(), BATCH, budget="8GB", hardware="h200", use_cache=False, fidelity="8bit")
    assert plan.fits and plan.strategy.optimizer == "adamw_foreach"
    assert any(n.startswith("optimizer adamw8bit refused") and "complex64" in n for n in plan.notes)
    assert plan.runners_up and not any("8bit" in r["label"] for r in plan.runners_up)


@pytest.mark.parametrize("optimizer", ["adamw_fused", "adamw8bit"])
def test_a_refused_optimizer_pinned_is_a_one_line_error(optimizer):
    with pytest.raises(InputError) as err:
        memopt.plan(SpectralNet(), BATCH, budget="8GB", hardware="h200", use_cache=False,
                    pins={"optimizer": optimizer}, fidelity="8bit")
    message = str(err.value)
    assert f"pin optimizer={optimizer!r} cannot be honoured" in message and "complex64" in message
    assert "\n" not in message.strip()


def test_real_models_keep_the_fused_adamw():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    plan = memopt.plan(model, {"input": torch.randn(8, 16)}, budget="8GB", hardware="h200", use_cache=False,
                       loss_fn=lambda out, batch: out.square().mean())
    assert plan.strategy.optimizer == "adamw_fused"
    assert not any("refused" in n and "optimizer" in n for n in plan.notes)


def test_wrapped_steps_update_the_complex_weights_as_torch_adamw_does():
    torch.manual_seed(0)
    model, ref = SpectralNet(), SpectralNet()
    ref.load_state_dict(model.state_dict())
    w = memopt.wrap(model, budget="8GB", sample=BATCH, hardware="h200", device="cpu", use_cache=False, lr=1e-3,
                    pins={"precision": "fp32", "micro_batch_size": 8}, autotune=False, guard=False)
    assert w.plan.strategy.optimizer == "adamw_foreach"
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0, foreach=True)
    for _ in range(2):
        loss = w.step(BATCH)
        expected = ref(**BATCH)["loss"]
        expected.backward()
        opt.step()
        opt.zero_grad()
        assert float(loss) == pytest.approx(float(expected.detach()), rel=1e-6)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)
    assert model.blocks[0].weight.dtype == torch.complex64


class Bf16Spectral(SpectralNet):
    """The FFT fed whatever the autocast gives it: bf16, which no FFT library runs."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        for b in self.blocks:
            spectrum = torch.fft.rfft(h, dim=1) * b.weight
            h = h + b.mix(torch.fft.irfft(spectrum, n=h.shape[1], dim=1))
        return {"loss": nn.functional.cross_entropy(self.head(h.mean(1)), labels)}


def test_one_failure_under_many_variants_is_one_note():
    plan = memopt.plan(Bf16Spectral(), BATCH, budget="8GB", hardware="h200", use_cache=False)
    assert plan.fits and plan.strategy.precision == "fp32"
    failed = [n for n in plan.notes if "the model's step fails" in n]
    assert len(failed) == 1, failed
    assert "Unsupported dtype BFloat16" in failed[0] and "amp/" in failed[0]
