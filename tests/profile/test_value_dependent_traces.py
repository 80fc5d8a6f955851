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
        if self.select in ("nonzero", "positive"):
            # the labelled rows (values of the batch, which the trace has), or the rows whose first logit is positive
            # (values it cannot know)
            rows = (labels >= 0).nonzero() if self.select == "nonzero" else (logits.detach()[:, 0] > 0).nonzero()
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
    plan = memopt.plan(LabelledRows("positive"), sample=_vectors(), budget="4GB", hardware="h200", use_cache=False)
    assert any("nonzero" in note and "largest" in note for note in plan.notes), plan.notes
    # selected by the batch's labels, whose values the trace has: sized exactly, nothing to say
    plan = memopt.plan(LabelledRows("nonzero"), sample=_vectors(), budget="4GB", hardware="h200", use_cache=False)
    assert not any("largest" in note for note in plan.notes), plan.notes


def test_a_selection_by_the_batch_values_has_its_real_size() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memopt.profile.tracker import MemoryTracker

    labels = torch.tensor([3, -100, 0, -100, -100, 1, 2, -100])  # 4 of 8 rows labelled
    with FakeTensorMode() as mode, MemoryTracker("cpu") as tracker:
        fake = mode.from_tensor(labels)
        tracker.shadows.adopt(fake, labels)
        hidden = torch.empty(BATCH, WIDTH)
        keep = fake >= 0
        shapes = [keep.nonzero().shape, hidden[keep].shape, hidden.masked_select(keep.unsqueeze(1)).shape,
                  torch.where(keep)[0].shape]
        unknown = hidden[:, 0] > 0  # values the trace cannot know: every row
        largest = [unknown.nonzero().shape, hidden[unknown].shape]
    assert shapes == [(4, 1), (4, WIDTH), (4 * WIDTH,), (4,)]
    assert largest == [(BATCH, 1), (BATCH, WIDTH)]
    assert tracker.run.bounded_ops == {"nonzero.default", "index.Tensor"}


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


EXPERTS, TOP_K, TOKENS = 4, 2, BATCH * 6


class EagerExperts(nn.Module):
    """A mixture of experts looped over in Python, as transformers' eager experts and JetMoE, LongCat-Flash and
    Switch write it: which experts were hit, each one's number (``.item()``, or formatted into a submodule name)
    and its tokens are read from the router's choice. ``read_values=False`` runs the same ops on the balanced
    routing written out as constants, reading nothing."""

    def __init__(self, read_values: bool) -> None:
        super().__init__()
        self.read_values = read_values
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.ModuleDict({f"expert_{i}": nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                                                   nn.Linear(4 * WIDTH, WIDTH))
                                      for i in range(EXPERTS)})
        self.head = nn.Linear(WIDTH, CLASSES)

    def _routes(self, chosen: torch.Tensor) -> list[tuple[nn.Module, torch.Tensor, torch.Tensor]]:
        if self.read_values:
            mask = nn.functional.one_hot(chosen, EXPERTS).permute(2, 1, 0)  # expert x slot x token
            routes = []
            for hit in (mask.sum(dim=(-1, -2)) > 0).nonzero():
                slot, token = torch.where(mask[int(hit.item())])
                routes.append((self.experts[f"expert_{hit[0]}"], slot, token))
            return routes
        tokens = chosen.size(0)
        balanced = [[(j, t) for j in range(TOP_K) for t in range(tokens) if (t * TOP_K + j) % EXPERTS == e]
                    for e in range(EXPERTS)]
        return [(self.experts[f"expert_{e}"], torch.tensor([j for j, _ in pairs]), torch.tensor([t for _, t in pairs]))
                for e, pairs in enumerate(balanced)]

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        weights, chosen = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        out = torch.zeros_like(x)
        for expert, slot, token in self._routes(chosen):
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return {"loss": nn.functional.cross_entropy(self.head(out), labels)}


def _tokens() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(TOKENS, WIDTH), "labels": torch.randint(0, CLASSES, (TOKENS,))}


def test_a_router_choice_nobody_knows_is_balanced_and_readable() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memopt.profile.scalar_values import ShadowFormatting
    from memopt.profile.tracker import MemoryTracker

    with FakeTensorMode() as mode, MemoryTracker("cpu") as tracker, ShadowFormatting(tracker.shadows):
        logits = mode.from_tensor(torch.randn(TOKENS, EXPERTS))
        chosen = logits.topk(TOP_K, dim=-1).indices
        top1 = logits.argmax(dim=-1)
        kept = logits.max(dim=0, keepdim=True).indices
        hit = (nn.functional.one_hot(chosen, EXPERTS).sum(dim=(0, 1)) > 0).nonzero()
        names = [f"expert_{h[0]}" for h in hit]
        numbers = [int(h.item()) for h in hit]
        every = (logits > 0).nonzero()  # no values: every position, whose indices are known
        last_row = int(every[-1, 0].item())
        shadows = [tracker.shadows.value(t) for t in (chosen, top1, kept)]
    real, real_top1, real_kept = shadows
    assert real.shape == (TOKENS, TOP_K)
    assert all(len(set(row.tolist())) == TOP_K for row in real)  # distinct experts per token
    assert torch.bincount(real.flatten(), minlength=EXPERTS).tolist() == [TOKENS * TOP_K // EXPERTS] * EXPERTS
    assert torch.bincount(real_top1, minlength=EXPERTS).tolist() == [TOKENS // EXPERTS] * EXPERTS
    assert real_kept.shape == (1, EXPERTS)
    assert hit.shape == (EXPERTS, 1) and names == [f"expert_{e}" for e in range(EXPERTS)]
    assert numbers == list(range(EXPERTS))
    assert every.shape == (TOKENS * EXPERTS, 2) and last_row == TOKENS - 1


def test_an_eager_expert_loop_is_traced_on_balanced_routing() -> None:
    """The loop read the router's choice and stopped the trace; now it is traced on the balanced routing: equal to
    the same ops on that routing written as constants, within the loop's own small routing tensors."""
    torch.manual_seed(0)
    balanced = _peak(EagerExperts(read_values=False), _tokens())
    torch.manual_seed(0)
    read = _peak(EagerExperts(read_values=True), _tokens())
    routing_tensors = 4 * EXPERTS * TOP_K * TOKENS * 8
    assert abs(read - balanced) <= routing_tensors, (read, balanced)
    assert read < balanced + 4 * TOKENS * TOP_K * 4 * WIDTH * 4  # not every expert given every token
