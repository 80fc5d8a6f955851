"""Micro-batching splits dim 0 of the batch: a model fed sequence-first batches (the layout PyTorch's recurrent layers
and multi-head attention take by default) must not be split there, and a model that transposes batch-first input
itself must stay free to be."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.profile.sample_axis_probe import probe_batch
from memopt.step.batch import split

V, T, B = 50, 12, 8


class SeqFirstLSTM(nn.Module):
    """Token ids (T, B) straight into an LSTM with batch_first=False."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(V, 16), nn.LSTM(16, 16, num_layers=2), nn.Linear(16, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.emb(x))[0])


class TransposesItself(nn.Module):
    """Batch-first ids (B, T), transposed for a GRU and attention that take (T, B, F)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(V, 16), nn.GRU(16, 16), nn.Linear(16, V)
        self.att = nn.MultiheadAttention(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.rnn(self.emb(x).transpose(0, 1))[0]
        return self.out(self.att(h, h, h)[0].transpose(0, 1))


def _loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, V), batch[1].reshape(-1))


def _profile(model: nn.Module, batch: object, loss_fn: object = _loss) -> memopt.Profile:
    return memopt.profile(model, batch, hardware="h100_80gb", loss_fn=loss_fn, use_cache=False)


def test_sequence_first_batches_are_not_micro_batched() -> None:
    torch.manual_seed(0)
    model = SeqFirstLSTM()
    x, y = torch.randint(0, V, (T, B)), torch.randint(0, V, (T, B))
    prof = _profile(model, (x, y))
    assert prof.micro_batch_refusal is not None and "LSTM rnn" in prof.micro_batch_refusal
    assert any("micro-batching refused" in n for n in prof.notes)
    # why: a "micro-batch" of dim 0 is a slice of time steps, and the loss changes
    full = _loss(model(x), (x, y))
    parts = [_loss(model(a), (a, b)) for a, b in zip(split(x, 4), split(y, 4))]
    assert not torch.allclose(full, torch.stack(parts).mean(), atol=1e-6)


def test_a_plan_for_sequence_first_batches_keeps_the_whole_batch() -> None:
    # at 1.2 GB the planner would take two micro-batches of 128 "samples" (time steps) in fp32 over the whole batch
    # in bf16; refused, it keeps all 256 time steps of every sequence together
    model = SeqFirstLSTM()
    x, y = torch.randint(0, V, (256, 64)), torch.randint(0, V, (256, 64))
    plan = memopt.make_plan(model, (x, y), budget="1.2GB", hardware="h100_80gb", loss_fn=_loss,
                            profile=_profile(model, (x, y)))
    assert plan.fits
    assert plan.strategy.micro_batch_size == 256 and plan.strategy.grad_accum_steps == 1


def test_models_that_transpose_batch_first_input_may_be_micro_batched() -> None:
    model = TransposesItself()
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    assert _profile(model, (x, y)).micro_batch_refusal is None
    # and splitting it is exact: the per-sample losses do not see the other samples
    full = _loss(model(x), (x, y))
    parts = [_loss(model(a), (a, b)) for a, b in zip(split(x, 4), split(y, 4))]
    torch.testing.assert_close(full, torch.stack(parts).mean(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch_first", [False, True])
def test_transformer_encoder_layout_follows_its_flag(batch_first: bool) -> None:
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=batch_first)
    model = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(16, 1))
    x = torch.randn(B, T, 16)  # samples along dim 0: right for batch_first=True only
    reason = probe_batch(model, lambda b, device: torch.randn(b, T, 16, device=device),
                         lambda out, batch: out.mean()).axis_refusal
    assert (reason is None) == batch_first
    if not batch_first:
        assert "MultiheadAttention" in reason and "dim 1" in reason
    copy.deepcopy(model)(x)  # the probe leaves the model untouched and runnable


def test_models_without_axis_layers_run_one_forward() -> None:
    calls = []

    def factory(b: int, device: str) -> torch.Tensor:
        calls.append(b)
        return torch.randn(b, 4, device=device)

    # the random draws need one forward; without a layer that names its batch axis there is no second
    probe = probe_batch(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), factory, lambda out, batch: out.mean())
    assert probe is not None and probe.axis_refusal is None
    assert calls == [1]


class DropoutMLP(nn.Module):
    """Residual MLP blocks with dropout over (B, 128, 512) inputs: activations dominate a 1.5 GB budget."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Dropout(p), nn.Linear(2048, 512))
                                    for _ in range(4))
        self.head = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(1))


def _cls_loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


def test_micro_batches_draw_other_dropout_masks() -> None:
    # why the "exact" fidelity refuses them: same seed, same batch, other masks, other loss
    model = DropoutMLP(0.1)
    x, y = torch.randn(8, 4, 512), torch.randint(0, 10, (8,))
    torch.manual_seed(0)
    full = _cls_loss(model(x), (x, y))
    torch.manual_seed(0)
    parts = [_cls_loss(model(a), (a, b)) for a, b in zip(split(x, 4), split(y, 4))]
    assert not torch.allclose(full, torch.stack(parts).mean(), atol=1e-4)


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_exact_fidelity_refuses_micro_batches_only_where_the_forward_draws(p: float) -> None:
    model = DropoutMLP(p)
    x, y = torch.randn(64, 128, 512), torch.randint(0, 10, (64,))
    prof = _profile(model, (x, y), _cls_loss)
    assert prof.forward_random_ops == (["bernoulli_"] if p else [])
    exact = memopt.make_plan(model, (x, y), budget="1.5GB", hardware="h100_80gb", loss_fn=_cls_loss, profile=prof,
                             fidelity="exact")
    refused = [n for n in exact.notes if "micro-batching refused under fidelity 'exact'" in n]
    if p:
        assert exact.strategy.micro_batch_size == 64 and refused and "bernoulli_" in refused[0]
    else:  # the same budget is met by splitting the batch
        assert exact.fits and exact.strategy.micro_batch_size < 64 and not refused
    default = memopt.make_plan(model, (x, y), budget="1.5GB", hardware="h100_80gb", loss_fn=_cls_loss, profile=prof)
    assert default.fits and not any("micro-batching refused" in n for n in default.notes)


def test_dropout_inside_a_fused_attention_kernel_is_a_random_draw() -> None:
    class Attn(nn.Module):
        def __init__(self, p: float) -> None:
            super().__init__()
            self.qkv, self.p = nn.Linear(16, 48), p

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0).mean()

    def factory(b: int, device: str) -> torch.Tensor:
        return torch.randn(b, 6, 16, device=device)

    assert probe_batch(Attn(0.0), factory).random_ops == ()
    drawn = probe_batch(Attn(0.2), factory).random_ops
    assert drawn and drawn != ("randn",)  # the factory's own random input is not the model's draw


def test_a_single_number_drawn_per_step_is_not_a_mask() -> None:
    # LayerDrop's per-step draw (OPT and BART draw it even at layerdrop 0) leaves the samples' computation alone
    class LayerDrop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                if not (self.training and torch.rand([]) < 0.0):
                    x = layer(x)
            return x.mean()

    assert probe_batch(LayerDrop(), lambda b, device: torch.randn(b, 8, device=device)).random_ops == ()


class DropPathMLP(DropoutMLP):
    """timm-style stochastic depth: each sample keeps or drops a block's residual, drawn with torch.rand(B, 1, 1),
    one number for a batch of one sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            keep = (torch.rand(x.shape[0], 1, 1) > 0.2).to(x.dtype) / 0.8 if self.training else 1.0
            x = x + block(x) * keep
        return self.head(x.mean(1))


def test_a_per_sample_draw_is_a_random_draw_though_one_sample_draws_one_number() -> None:
    probe = probe_batch(DropPathMLP(0.0), lambda b, device: torch.randn(b, 4, 512, device=device),
                        lambda out, batch: out.mean())
    assert probe is not None and probe.random_ops == ("rand",)
    model = DropPathMLP(0.0)
    x, y = torch.randn(64, 128, 512), torch.randint(0, 10, (64,))
    exact = memopt.make_plan(model, (x, y), budget="1.5GB", hardware="h100_80gb", loss_fn=_cls_loss,
                             fidelity="exact", use_cache=False)
    refused = [n for n in exact.notes if "micro-batching refused under fidelity 'exact'" in n]
    assert exact.strategy.micro_batch_size == 64 and refused and "rand" in refused[0]


def test_a_pinned_split_of_sequence_first_batches_warns_where_it_runs() -> None:
    model = SeqFirstLSTM()
    x, y = torch.randint(0, V, (T, B)), torch.randint(0, V, (T, B))
    with pytest.warns(UserWarning, match="LSTM rnn .* pin micro_batch_size=12"):
        memopt.wrap(model, budget="20GB", hardware="h100_80gb", sample=(x, y), loss_fn=_loss,
                    pins={"micro_batch_size": 4})


def test_a_pinned_split_under_exact_fidelity_of_a_model_that_draws_says_so_and_warns() -> None:
    """The note said "refused" while the pin split the batch, and nothing warned where it ran."""
    model = DropoutMLP(0.1)
    x, y = torch.randn(8, 128, 512), torch.randint(0, 10, (8,))
    with pytest.warns(UserWarning, match=r"micro-batches of 2, but its training forward draws random numbers"):
        w = memopt.wrap(model, budget="16GB", hardware="h100_80gb", sample=(x, y), loss_fn=_cls_loss,
                        fidelity="exact", pins={"micro_batch_size": 2}, guard=False)
    assert w.plan.strategy.micro_batch_size == 2
    assert any(n.startswith("micro_batch_size=2 is pinned, so the batch is split although the split is not exact")
               for n in w.plan.notes)
    assert not any("micro-batching refused" in n for n in w.plan.notes)


class LongGRU(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(V, 16), nn.Linear(16, V)
        self.rnn = nn.GRU(16, 16, num_layers=2, batch_first=True, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.emb(x))[0]).mean()


def _ids(b: int, device: str) -> torch.Tensor:
    return torch.zeros(b, 2048, dtype=torch.long, device=device)


def test_a_recurrent_layer_is_probed_as_one_fused_kernel(monkeypatch) -> None:
    """The CPU would unroll 2,048 steps x 2 layers into ~20k ops per forward (80 s for a 3-layer GRU); the probe runs
    the trace's fused stand-in instead, and still sees the batch axis."""
    import memopt.profile.recurrent_kernels as kernels
    fused, calls = kernels._fused, []
    monkeypatch.setattr(kernels, "_fused", lambda *a, **k: calls.append(1) or fused(*a, **k))
    probe = probe_batch(LongGRU(), _ids)
    assert probe is not None and probe.axis_refusal is None and probe.random_ops == ()
    assert len(calls) == 2  # one fused call per forward, at 1 and at 2 samples


def test_dropout_between_stacked_recurrent_layers_is_a_random_draw() -> None:
    assert probe_batch(LongGRU(dropout=0.1), _ids).random_ops == ("gru(dropout=0.1)",)
