"""Models that branch on tensor values or select by them: the trace follows the step a real run takes.

Each model is paired with one that runs the same ops without reading values; a real step of the two allocates
the same, so their estimates must be equal.
"""

from __future__ import annotations

import torch
from torch import nn

import memopt

WIDTH, LAYERS, BATCH, CLASSES = 64, 4, 8, 5


def _peak(model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
    plan = memopt.plan(model, sample=batch, budget="4GB", hardware="h200", use_cache=False,
                       pins={"precision": "fp32", "checkpointing": "none", "micro_batch_size": BATCH})
    return plan.peak_allocated_bytes


class LayerDropNet(nn.Module):
    """LayerDrop as transformers' older encoders write it: a uniform draw read on every layer."""

    def __init__(self, layerdrop: float | None) -> None:
        super().__init__()
        self.layerdrop = layerdrop
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
                                    for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        for layer in self.layers:
            if self.layerdrop is not None and self.training and torch.rand([]) < self.layerdrop:
                continue
            x = x + layer(x)
        scale = torch.tensor(2.0)
        if scale > 1.0:  # a constant read as a Python bool
            x = x * 0.5
        return {"loss": nn.functional.cross_entropy(self.head(x), labels)}


def _vectors() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(BATCH, WIDTH), "labels": torch.randint(0, CLASSES, (BATCH,))}


def test_layerdrop_of_zero_traces_every_layer() -> None:
    torch.manual_seed(0)
    assert _peak(LayerDropNet(0.0), _vectors()) == _peak(LayerDropNet(None), _vectors())


def test_layerdrop_is_traced_as_the_step_where_every_layer_runs() -> None:
    torch.manual_seed(0)
    assert _peak(LayerDropNet(0.5), _vectors()) == _peak(LayerDropNet(None), _vectors())


class LabelledRows(nn.Module):
    """A head that keeps the rows whose label is present (DeBERTa's classification head), or all of them."""

    def __init__(self, select: str) -> None:
        super().__init__()
        self.select = select
        self.body = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.body(x))
        if self.select == "nonzero":
            rows = (labels >= 0).nonzero()
            logits = logits.gather(0, rows.expand(rows.size(0), logits.size(1)))
            labels = labels.gather(0, rows.view(-1))
        elif self.select == "mask":
            keep = labels >= 0
            logits, labels = logits[keep], labels[keep]
        elif self.select == "masked_select":
            keep = (labels >= 0).unsqueeze(1).expand_as(logits)
            logits = logits.masked_select(keep).view(-1, CLASSES)
        else:
            rows = torch.arange(labels.size(0)).unsqueeze(1)
            logits = logits.gather(0, rows.expand(rows.size(0), logits.size(1)))
            labels = labels.gather(0, rows.view(-1))
        return {"loss": nn.functional.cross_entropy(logits, labels)}


def test_selections_by_value_are_traced_at_their_largest() -> None:
    torch.manual_seed(0)
    every_row = _peak(LabelledRows("all"), _vectors())
    nonzero = _peak(LabelledRows("nonzero"), _vectors())
    assert nonzero == every_row
    for select in ("mask", "masked_select"):
        # the same rows, kept by a boolean index or a masked copy instead of a gather: within a few tensors
        assert abs(_peak(LabelledRows(select), _vectors()) - every_row) <= 4 * BATCH * WIDTH * 4, select


def test_the_profile_says_which_ops_it_bounded() -> None:
    torch.manual_seed(0)
    plan = memopt.plan(LabelledRows("nonzero"), sample=_vectors(), budget="4GB", hardware="h200", use_cache=False)
    assert any("nonzero" in note and "largest" in note for note in plan.notes), plan.notes


def test_the_batch_ids_and_masks_carry_their_real_values_into_the_trace() -> None:
    """XLM reads ``lengths.max().item()`` from its token ids, Longformer counts the global tokens of a float mask
    made from the attention mask: the trace reads the values of the real batch the factory makes, through integer,
    boolean and float ops computed from them alone and through a model's default mask (``torch.ones``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memopt.profile.scalar_values import MAX_ELEMENTS
    from memopt.profile.tracker import MemoryTracker

    ids = torch.zeros(4, 16, dtype=torch.long)
    ids[0, :2], ids[1, :3], ids[2, :1] = 7, 5, 3  # rows of 2, 3, 1 and 0 tokens, padded with 0
    with FakeTensorMode() as mode, MemoryTracker("cpu") as tracker:
        fake = mode.from_tensor(ids)
        tracker.shadows.adopt(fake, ids)
        assert (fake != 0).sum(dim=1).max().item() == 3  # the longest row, not a guess
        mask = (fake != 0).long()
        extended = (1.0 - mask.float()) * -10000.0  # B x L floats: larger than a control value, still shadowed
        assert extended.numel() > MAX_ELEMENTS
        assert bool((extended < 0).any()) is True
        assert (extended > 0).sum().item() == 0  # Longformer's global-token count
        default = torch.ones(2, 4, dtype=torch.long)
        assert (default * 2).sum().item() == 16  # 2 x 4 twos
        noise = torch.rand(4, 8)  # a large random draw stays data: its reads keep the tracker's default
        assert tracker.shadows.value(noise) is None and tracker.shadows.value(noise < 0.5) is None
        written = fake.clone()
        assert tracker.shadows.value(written) is not None
        written.masked_fill_(noise[:, :1] < 0.5, 9)  # written with values the trace cannot know
        assert tracker.shadows.value(written) is None


def test_a_hugging_face_model_reading_its_batch_lengths_is_planned() -> None:
    """XLM's forward asserts ``lengths.max().item() <= slen`` on the lengths it derives from the token ids: the
    trace stopped there before the batch's values reached it."""
    import transformers

    config = transformers.XLMConfig(vocab_size=128, emb_dim=32, n_layers=2, n_heads=2, max_position_embeddings=64)
    model = transformers.XLMWithLMHeadModel(config).train()
    plan = memopt.plan(model, sample={"batch_size": 2, "seq_len": 16}, budget="4GB", hardware="h200",
                       use_cache=False, pins={"precision": "fp32", "checkpointing": "none"})
    assert plan.fits and plan.peak_allocated_bytes > 0
