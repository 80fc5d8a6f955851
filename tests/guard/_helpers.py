"""A tiny language model, batches and loops shared by the guard tests (CPU, deterministic)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64
DIM = 32


class Block(nn.Module):
    def __init__(self, dim: int, p: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.fc2(F.gelu(self.fc1(self.norm(h)))))


class TinyLM(nn.Module):
    """Embedding, a stack of MLP blocks (checkpointable), a head; returns {"loss", "logits"}."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, dropout) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                state: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        if state is not None:
            h = h + state
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        out = {"logits": logits, "hidden": h}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                          ignore_index=-100)
        return out


def make_batch(batch_size: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return {"input_ids": ids, "labels": labels}


def make_model(seed: int = 0, **kw) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kw)


def fake_plan(strategy, *, global_batch: int = 4, total: int = 400 << 20, runtime: int = 100 << 20,
              budget: int = 1 << 30, peak_at: str = "step 1, micro-batch 1, backward: head", policy=None):
    """A plan for ``strategy`` with made-up predictions (recovery logic does not need real ones)."""
    from memopt.plan.policy import Policy
    from memopt.plan.schema import Plan

    reserved = total - runtime
    allocated = reserved - reserved // 20
    parts = {"parameters": 0.05, "gradients": 0.05, "optimizer_states": 0.10, "activations": 0.55}
    breakdown = {k: int(f * allocated) for k, f in parts.items()}
    breakdown["temporaries"] = allocated - sum(breakdown.values())
    breakdown["allocator_overhead"] = reserved - allocated
    breakdown["runtime"] = runtime
    prediction = {"peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved, "runtime_bytes": runtime,
                  "total_bytes": total, "step_time_s": 0.1, "breakdown": breakdown, "peak_at": peak_at}
    return Plan(fits=True, strategy=strategy, budget_bytes=budget, margin_bytes=(256 << 20) // 16,
                prediction=prediction, model={"name": "tiny", "profile_key": "tinykey"}, hardware="h100_80gb",
                policy=(policy or Policy()).to_dict(), global_batch=global_batch)


def batches(n: int, batch_size: int = 4, seq_len: int = 12) -> list[dict[str, torch.Tensor]]:
    return [make_batch(batch_size, seq_len, seed=1000 + i) for i in range(n)]


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]
