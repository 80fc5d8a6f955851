"""Plain-PyTorch models in the patterns users bring: dict batches, a dict output with the loss, or a bare
tensor / tuple output read by ``loss_fn(output, batch)``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

H = 32


def _ce(output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = output[0] if isinstance(output, tuple) else output
    return F.cross_entropy(logits, batch["labels"])


def _summed_mse(output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A loss summed over the samples (an ELBO-style objective), not averaged."""
    return F.mse_loss(output["logits"], F.one_hot(batch["labels"], output["logits"].shape[-1]).float(),
                      reduction="sum")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.up = nn.Linear(H, 2 * H)
        self.down = nn.Linear(2 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    """Repeated blocks, returns {'loss': ...}."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(16, H)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(H, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return {"loss": F.cross_entropy(self.head(h), labels)}


class ResidualLogits(ResidualMLP):
    """The same blocks; returns {'logits': ...} for the user's loss_fn (the target is not used)."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return {"logits": self.head(h)}


class NoRepeatedBlocks(nn.Module):
    """Distinct layers only: nothing to checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 48), nn.Linear(48, 24), nn.Linear(24, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.cross_entropy(self.c(torch.relu(self.b(torch.relu(self.a(x))))), labels)}


class GRUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, H)
        self.rnn = nn.GRU(H, H, num_layers=2, batch_first=True)
        self.head = nn.Linear(H, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h, _ = self.rnn(self.inp(x))
        return {"loss": F.cross_entropy(self.head(h[:, -1]), labels)}


class LSTMTuple(nn.Module):
    """Returns a tuple (logits, hidden): the loss comes from loss_fn."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, H, batch_first=True)
        self.head = nn.Linear(H, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h, (hn, _) = self.rnn(x)
        return self.head(h[:, -1]), hn


class MHABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(H, 4, batch_first=True)
        self.norm = nn.LayerNorm(H)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.norm(h + a)


class SequenceNet(nn.Module):
    """Three blocks over a sequence, classified from its mean."""

    def __init__(self, block: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.inp = nn.Linear(16, H)
        self.blocks = nn.ModuleList(block() for _ in range(3))
        self.head = nn.Linear(H, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return {"loss": F.cross_entropy(self.head(h.mean(1)), labels)}


class MHANet(SequenceNet):
    def __init__(self) -> None:
        super().__init__(MHABlock)


class ConvBN(nn.Module):
    """BatchNorm: its statistics depend on the micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
                                    for _ in range(3))
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.stem(pixels)
        for b in self.blocks:
            h = b(h)
        return {"loss": F.cross_entropy(self.head(h.mean((2, 3))), labels)}


class TiedEmbedding(nn.Module):
    """Weight sharing: the head is the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, H)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(H, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return {"loss": F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())}


class CalledTwice(nn.Module):
    """One module applied twice in a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, H)
        self.shared = Block()
        self.head = nn.Linear(H, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.shared(self.shared(self.inp(x)))
        return {"loss": F.cross_entropy(self.head(h), labels)}


class SharedLayer(nn.Module):
    """One layer applied four times with one set of weights (``nn.ModuleList([layer] * 4)``, a looped transformer):
    not a stack of blocks memopt can checkpoint one by one."""

    def __init__(self, applications: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(16, H)
        layer = Block()
        self.layers = nn.ModuleList([layer] * applications)
        self.head = nn.Linear(H, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return {"loss": F.cross_entropy(self.head(h), labels)}


class Frozen(ResidualMLP):
    """The input layer and the first block frozen."""

    def __init__(self) -> None:
        super().__init__()
        for p in [*self.inp.parameters(), *self.blocks[0].parameters()]:
            p.requires_grad_(False)


class CountingBuffer(nn.Module):
    """A buffer updated in every forward (a running mean of the inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(16))
        self.inner = ResidualMLP()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.inner(x - self.mean, labels)


class ReturnsLoss(nn.Module):
    """Returns the loss tensor itself (read by loss_fn=lambda out, batch: out)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = ResidualMLP()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.inner(x, labels)["loss"]


class LogitsAndLoss(ResidualMLP):
    """Returns ``(logits, loss)`` as nanoGPT-style models do, with no loss_fn: the one scalar output is the loss."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        logits = self.head(h)
        return logits, F.cross_entropy(logits, labels)


class SpectralBlock(nn.Module):
    """Mixing along the sequence in Fourier space with complex weights (a Fourier neural operator's layer). The
    FFT runs in fp32, as such models cast it: cuFFT and PocketFFT have no bf16 kernel."""

    def __init__(self, length: int = 6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(length // 2 + 1, H, dtype=torch.complex64) / H)
        self.mix = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(x.float(), dim=1) * self.weight
        return x + self.mix(F.gelu(torch.fft.irfft(spectrum, n=x.shape[1], dim=1)))


class SpectralNet(SequenceNet):
    """Complex parameters: the optimizers that step only real ones (torch's fused AdamW, 8-bit states) are refused."""

    def __init__(self) -> None:
        super().__init__(SpectralBlock)


class ParametrizedStack(nn.Module):
    """A stack of weight-normed layers (``torch.nn.utils.parametrizations.weight_norm``, as vocoders and wav2vec2's
    convolutions use): parametrize gives each layer a class of its own, yet they are one kind of block."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, H)
        self.blocks = nn.ModuleList(nn.utils.parametrizations.weight_norm(nn.Linear(H, H)) for _ in range(4))
        self.head = nn.Linear(H, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return {"loss": F.cross_entropy(self.head(h), labels)}


class InplaceBlock(Block):
    """Writes into a Linear's output in place: ``nn.ReLU(inplace=True)`` and ``out += x``."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(self.act(self.up(self.norm(x))))
        out += x
        return out


class InplaceActivations(ResidualMLP):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(InplaceBlock() for _ in range(4))


def _masked_mean(output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy over the samples whose label is not -100 (unlabelled samples in a semi-supervised batch)."""
    return F.cross_entropy(output["logits"], batch["labels"])


@dataclass(frozen=True)
class Pattern:
    name: str
    build: Callable[[], nn.Module]
    sample: Callable[[int], dict[str, torch.Tensor]]
    technique: str
    loss_fn: Callable[[Any, dict[str, Any]], torch.Tensor] | None = None
    max_grad_norm: float | None = None
    optimizer: str | None = None  # the estimate's optimizer where the planner's default cannot train the model


def _vectors(n: int, g: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(n, 16, generator=g), "labels": torch.randint(0, 4, (n,), generator=g)}


def _sequences(n: int, g: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(n, 6, 16, generator=g), "labels": torch.randint(0, 4, (n,), generator=g)}


def _images(n: int, g: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    return {"pixels": torch.randn(n, 3, 8, 8, generator=g), "labels": torch.randint(0, 4, (n,), generator=g)}


def _partly_labelled(n: int, g: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Every fourth sample unlabelled (-100), so micro-batches hold different numbers of labelled samples."""
    batch = _vectors(n, g)
    batch["labels"][1::4] = -100
    return batch


def _tokens(n: int, g: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (n, 8), generator=g)
    return {"ids": ids, "labels": ids.roll(-1, 1)}


PATTERNS: list[Pattern] = [
    Pattern("residual_mlp", ResidualMLP, _vectors, "partial"),
    Pattern("no_repeated_blocks", NoRepeatedBlocks, _vectors, "micro_batch"),
    Pattern("gru", GRUNet, _sequences, "micro_batch"),
    Pattern("lstm_tuple_output", LSTMTuple, _sequences, "offload", loss_fn=_ce),
    Pattern("multihead_attention", MHANet, _sequences, "full"),
    Pattern("batchnorm", ConvBN, _images, "full"),
    Pattern("weight_sharing", TiedEmbedding, _tokens, "selective"),
    Pattern("module_called_twice", CalledTwice, _vectors, "micro_batch"),
    Pattern("one_layer_listed_n_times", SharedLayer, _vectors, "offload"),
    Pattern("frozen_parameters", Frozen, _vectors, "full"),
    Pattern("buffer_updated_in_forward", CountingBuffer, _vectors, "full"),
    Pattern("returns_the_loss", ReturnsLoss, _vectors, "offload", loss_fn=lambda out, batch: out),
    Pattern("gradient_clipping", ResidualMLP, _vectors, "micro_batch", max_grad_norm=0.05),
    Pattern("returns_logits_and_loss", LogitsAndLoss, _vectors, "partial"),
    Pattern("loss_summed_over_samples", ResidualLogits, _vectors, "micro_batch", loss_fn=_summed_mse),
    Pattern("complex_parameters", SpectralNet, _sequences, "full", optimizer="adamw_foreach"),
    Pattern("parametrized_blocks", ParametrizedStack, _vectors, "partial"),
    Pattern("inplace_activations", InplaceActivations, _vectors, "full"),
    Pattern("partly_labelled_samples", ResidualLogits, _partly_labelled, "micro_batch", loss_fn=_masked_mean),
]
