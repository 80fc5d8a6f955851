"""The batch and loss contract (memopt.step.batch): tuples, lists, tensors, dicts with extra keys and nested
batches train through memopt.wrap exactly as an unwrapped loop does, micro-batched or not."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memopt
from memopt.step import batch as B
from memopt.step.batch_samples import batch_size, indivisible
from memopt.step.batch_tree import structure
from memopt.step.forward_signature import takes_the_whole_dict
from tests.reference_loop import losses_of_plain_loop


class Blocks(nn.Module):
    """Four identical blocks and a head: forward(x) -> logits."""

    def __init__(self, d: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(4)])
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


class LossInside(Blocks):
    """forward(x, y) -> the mean loss (a model that takes the target)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(x)
        return F.cross_entropy(out, y) if y is not None else out.pow(2).mean()


def _wrap(model: nn.Module, sample, micro: int, pins: dict | None = None, **kw):
    return memopt.wrap(model, budget="4GB", sample=sample, hardware="h100_80gb", device="cpu", use_cache=False,
                       pins={"micro_batch_size": micro, "precision": "fp32", **(pins or {})},
                       optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2), **kw)


def _reference(model: nn.Module, batches, loss_of, steps: int = 3):
    """The unwrapped loop: the whole batch's loss, AdamW at the same lr."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in batches[:steps]:
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _assert_same(wrapped, ref_model, got, want):
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for (n, p), q in zip(wrapped.model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def _xy(n: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randint(0, 5, (n,), generator=g)


@pytest.mark.parametrize("micro", [8, 2])
def test_tuple_batch_with_loss_fn_trains_exactly(micro):
    torch.manual_seed(0)
    model = Blocks()
    ref = copy.deepcopy(model)
    batches = [_xy(seed=i) for i in range(3)]
    wrapped = _wrap(model, batches[0], micro, loss_fn=lambda out, b: F.cross_entropy(out, b[1]))
    assert wrapped.plan.strategy.micro_batch_size == micro
    got = [wrapped.step(b) for b in batches]
    want = _reference(ref, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    _assert_same(wrapped, ref, got, want)


def test_list_of_one_tensor_and_a_model_returning_its_loss():
    torch.manual_seed(0)
    model = LossInside()
    ref = copy.deepcopy(model)
    batches = [[_xy(seed=i)[0]] for i in range(3)]
    wrapped = _wrap(model, batches[0], 4)
    got = [wrapped.step(b) for b in batches]  # raised AttributeError: 'list' object has no attribute 'values'
    want = _reference(ref, batches, lambda m, b: m(b[0]))
    _assert_same(wrapped, ref, got, want)


def test_tuple_passed_whole_to_a_model_that_takes_the_target():
    torch.manual_seed(0)
    model = LossInside()
    ref = copy.deepcopy(model)
    batches = [_xy(seed=i) for i in range(3)]
    wrapped = _wrap(model, batches[0], 4)  # no loss_fn: model(x, y) returns the loss
    got = [wrapped.step(b) for b in batches]
    want = _reference(ref, batches, lambda m, b: m(*b))
    _assert_same(wrapped, ref, got, want)


def test_tensor_batch_is_the_model_input():
    torch.manual_seed(0)
    model = LossInside()
    ref = copy.deepcopy(model)
    batches = [_xy(seed=i)[0] for i in range(3)]
    wrapped = _wrap(model, batches[0], 2)
    got = [wrapped.step(b) for b in batches]
    want = _reference(ref, batches, lambda m, b: m(b))
    _assert_same(wrapped, ref, got, want)


def test_dict_with_a_target_beside_the_inputs_is_not_passed_to_forward():
    torch.manual_seed(0)
    model = Blocks()
    ref = copy.deepcopy(model)
    batches = [dict(zip(("x", "targets"), _xy(seed=i))) for i in range(3)]
    wrapped = _wrap(model, batches[0], 4, loss_fn=lambda out, b: F.cross_entropy(out, b["targets"]))
    got = [wrapped.step(b) for b in batches]  # raised TypeError: forward() got an unexpected keyword 'targets'
    want = _reference(ref, batches, lambda m, b: F.cross_entropy(m(b["x"]), b["targets"]))
    _assert_same(wrapped, ref, got, want)


def test_training_step_on_a_nested_batch():
    torch.manual_seed(0)
    model = Blocks()
    ref = copy.deepcopy(model)

    def step(m, b):
        (x, noise), y = b["inputs"], b["y"]
        return F.cross_entropy(m(x + 0.1 * noise), y)

    def nested(i):
        x, y = _xy(seed=i)
        return {"inputs": (x, torch.randn_like(x)), "y": y, "epoch": 0}  # a non-tensor leaf rides along

    batches = [nested(i) for i in range(3)]
    wrapped = _wrap(model, batches[0], 2, training_step=step)
    got = [wrapped.step(b) for b in batches]
    want = _reference(ref, batches, step)
    _assert_same(wrapped, ref, got, want)


def test_per_token_labels_weight_micro_batches_by_their_loss_tokens():
    """Micro-batches with different numbers of -100 labels: weighted by tokens, the accumulated step equals the
    whole batch's mean over every loss token (a per-sample weighting would not)."""
    torch.manual_seed(0)
    vocab, t = 7, 6

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, 16)
            self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
            self.head = nn.Linear(16, vocab)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.emb(ids)
            for layer in self.layers:
                h = h + torch.tanh(layer(h))
            return self.head(h)

    def loss_fn(out, b):
        return F.cross_entropy(out.flatten(0, 1), b[1].flatten())  # mean over labels != -100

    def batch(i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, vocab, (4, t), generator=g)
        labels = ids.clone()
        labels[:2, 1:] = -100  # the first micro-batch carries 2 tokens, the second 12
        return ids, labels

    model = Tagger()
    ref = copy.deepcopy(model)
    batches = [batch(i) for i in range(3)]
    assert [B.count_loss_items(mb) for mb in B.split(batches[0], 2)] == [2, 12]
    wrapped = _wrap(model, batches[0], 2, loss_fn=loss_fn)
    got = [wrapped.step(b) for b in batches]
    want = _reference(ref, batches, lambda m, b: loss_fn(m(b[0]), b))
    _assert_same(wrapped, ref, got, want)


def test_split_and_move_keep_the_structure():
    x, y = _xy(6)
    nested = {"a": (x, [y, "tag"]), "scalar": torch.tensor(3.0), "n": 1}
    parts = B.split(nested, 4)
    assert [batch_size(p) for p in parts] == [4, 2]
    assert isinstance(parts[1]["a"], tuple) and isinstance(parts[1]["a"][1], list) and parts[1]["a"][1][1] == "tag"
    torch.testing.assert_close(parts[1]["a"][0], x[4:])
    assert parts[0]["scalar"] is nested["scalar"] and parts[0]["n"] == 1  # 0-d and non-tensors: every micro-batch
    moved = B.to_device(nested, "meta")
    assert moved["a"][1][0].device.type == "meta" and moved["a"][1][1] == "tag"


@pytest.mark.parametrize("bad, words", [
    ({"x": torch.zeros(4, 2), "y": torch.zeros(3)}, "disagree on dim 0 .*plan was made for a batch of 8 samples"),
    # TRL's padding-free packing: every sequence in one row, cu_seq_lens_q marking where each starts
    ({"input_ids": torch.zeros(1, 40, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 9, 25, 40])},
     r"packed without padding .*padding_free=False"),
    ("text", "cannot train on a batch of type str"),
    ((1, 2), "holds no tensor with a batch dimension"),
])
def test_bad_batches_get_one_line_errors(bad, words):
    torch.manual_seed(0)
    wrapped = _wrap(Blocks(), _xy(), 8, loss_fn=lambda out, b: F.cross_entropy(out, b[1]))
    with pytest.raises(ValueError, match=words) as info:
        wrapped.step(bad)
    assert "\n" not in str(info.value)


def test_loss_fn_and_training_step_together_are_refused():
    with pytest.raises(ValueError, match="not both"):
        memopt.wrap(Blocks(), budget="4GB", sample=_xy(), hardware="h100_80gb", device="cpu",
                    loss_fn=lambda o, b: o.sum(), training_step=lambda m, b: m(b[0]).sum())


def test_a_training_step_passed_as_loss_fn_is_named_with_the_fix():
    """A (model, batch) function passed as loss_fn is refused where it is given when its first parameter names the
    model, and in one line at the trace otherwise (it calls the output); passed as training_step, it trains."""
    def step_of(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    with pytest.raises(ValueError, match=r"first parameter is named 'model'.*pass training_step="):
        _wrap(Blocks(), _xy(), 4, loss_fn=step_of)
    with pytest.raises(ValueError, match=r"called its first argument, the model's output.*training_step=") as info:
        _wrap(Blocks(), _xy(), 4, loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    assert "\n" not in str(info.value)
    x, y = _xy()
    assert _wrap(Blocks(), (x, y), 4, training_step=step_of).step((x, y)) > 0


@pytest.mark.parametrize("hf_model, chunked_ce", [(False, 0), (True, 0), (True, 2)],
                         ids=["custom", "llama", "llama-chunked-ce"])
def test_a_tokenizers_batch_encoding_is_the_dict_it_holds(hf_model, chunked_ce):
    """A tokenizer's or collator's ``BatchEncoding`` (a ``UserDict``, not a ``dict``) is planned and trained as the
    dict batch it holds: the same losses and parameters as the unwrapped loop, at micro-batch 2 of 4, with the
    model's own loss or memopt's chunked cross-entropy in its place (which refused it as "a non-dict batch" on the
    H200, after planning it)."""
    from transformers import BatchEncoding, LlamaConfig, LlamaForCausalLM

    g = torch.Generator().manual_seed(0)
    if hf_model:
        build = lambda: LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,  # noqa: E731
                                                     num_hidden_layers=2, num_attention_heads=4,
                                                     num_key_value_heads=2))
        ids = torch.randint(0, 64, (4, 8), generator=g)
        batch, kw = BatchEncoding({"input_ids": ids, "labels": ids.clone()}), {}
        loss_of = lambda m, b: m(**b).loss  # noqa: E731
    else:
        build = Blocks
        batch = BatchEncoding({"x": torch.randn(4, 16, generator=g), "labels": torch.randint(0, 5, (4,), generator=g)})
        kw = {"loss_fn": lambda out, b: F.cross_entropy(out, b["labels"])}
        loss_of = lambda m, b: F.cross_entropy(m(b["x"]), b["labels"])  # noqa: E731
    torch.manual_seed(0)
    ref = build()
    model = copy.deepcopy(ref)
    want = _reference(ref, [batch] * 3, loss_of)
    w = _wrap(model, batch, 2, pins={"chunked_ce": chunked_ce}, **kw)
    assert w.plan.strategy.chunked_ce == chunked_ce
    got = [w.step(batch) for _ in range(3)]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for (n, p), q in zip(w.model.named_parameters(), ref.parameters()):
        # AdamW (lr 1e-2) divides by the root of the squared gradient: the two micro-batches' summation order moves
        # an element of a near-zero gradient by up to ~1e-3 of the learning rate
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=n)


@dataclasses.dataclass
class Batch:
    """A dataclass batch: inputs, a target, a field that is not per sample and one derived from the others."""
    x: torch.Tensor
    y: torch.Tensor
    tag: str = "train"
    n: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.n = len(self.y)


class TakesTheBatch(Blocks):
    def forward(self, batch: Batch) -> torch.Tensor:  # type: ignore[override]
        assert batch.tag == "train" and batch.n == len(batch.x)
        return super().forward(batch.x)


@pytest.mark.parametrize("how", ["loss_fn", "training_step"])
def test_a_dataclass_batch_is_split_by_its_fields(how):
    """Each micro-batch is the dataclass again (its derived field made anew, its other fields passed as they are);
    the model takes it whole, or the training_step calls the model: losses and parameters are the unwrapped loop's."""
    x, y = _xy()
    batch = Batch(x, y)
    torch.manual_seed(0)
    ref = TakesTheBatch()
    model = copy.deepcopy(ref)
    want = _reference(ref, [batch] * 3, lambda m, b: F.cross_entropy(m(b), b.y))
    kw = ({"loss_fn": lambda out, b: F.cross_entropy(out, b.y)} if how == "loss_fn"
          else {"training_step": lambda m, b: F.cross_entropy(m(b), b.y)})
    w = _wrap(model, batch, 2, **kw)
    got = [w.step(batch) for _ in range(3)]
    _assert_same(w, ref, got, want)
    micro = B.split(batch, 2)
    assert [type(mb) for mb in micro] == [Batch] * 4 and [mb.n for mb in micro] == [2] * 4
    assert structure(batch)["fields"]["tag"] == {"value": "'train'"}


@pytest.mark.parametrize("loss", [False, True])
def test_dataset_rows_not_collated_are_named_with_the_fix(loss):
    rows = [{"x": torch.randn(16), "labels": torch.tensor(1)} for _ in range(4)]
    kw = {"loss_fn": lambda out, b: out.sum()} if loss else {}
    with pytest.raises(ValueError, match=r"list of 4 dicts with the same keys.*default_collate") as info:
        _wrap(Blocks(), rows, 4, **kw)
    assert "\n" not in str(info.value)


def test_profile_of_a_tuple_batch_equals_the_same_batch_as_a_dict():
    """The trace follows the contract: the model traced from (x, y) allocates what it does from {'x', 'y'}."""
    torch.manual_seed(0)
    x, y = _xy(8)
    s = memopt.Strategy(micro_batch_size=4, grad_accum_steps=2)
    ests = []
    for sample, fn in (((x, y), lambda out, b: F.cross_entropy(out, b[1])),
                       ({"x": x, "y": y}, lambda out, b: F.cross_entropy(out, b["y"]))):
        prof = memopt.profile(Blocks(), sample, hardware="h100_80gb", loss_fn=fn, use_cache=False)
        ests.append(memopt.estimate(prof, s))
    assert ests[0].peak_allocated_bytes == ests[1].peak_allocated_bytes > 0


def test_the_guard_retries_the_same_tuple_batch_after_an_oom():
    """An OOM in backward of a tuple-batch step: the guard re-plans and re-runs that same (x, y) batch, and the
    run ends where the unwrapped loop does."""
    from memopt.guard.faults import FaultInjector

    torch.manual_seed(0)
    model = Blocks(d=128)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    # long sequences: activations are a fair share of the plan's memory, so a smaller plan exists
    batches = [(torch.randn(8, 1024, 128, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(3)]

    def loss_fn(out, b):
        return F.cross_entropy(out.mean(1), b[1])

    wrapped = memopt.wrap(model, budget="16GB", sample=batches[0], hardware="h100_80gb", device="cpu",
                          use_cache=False, loss_fn=loss_fn, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                          pins={"precision": "fp32"})
    got = [wrapped.step(batches[0])]
    before = wrapped.plan.strategy
    injector = FaultInjector(at_attempt=1, phase="backward", after_ops=3)
    wrapped.guard.oom.phase_listeners.append(injector.on_phase)
    injector.attempt = 0  # the first step already ran
    with injector:
        got.append(wrapped.step(batches[1]))
    # it did run out, and went on under a new plan (wrapped.plan said the old one after a micro-batch-only re-plan)
    assert injector.fired and wrapped.plan.strategy != before
    got.append(wrapped.step(batches[2]))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for x, y in batches:
        loss = loss_fn(ref(x), (x, y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(loss.detach()))
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(wrapped.model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_autotune_times_tuple_batches():
    """wrap's measured choice among checkpointing modes (on by default on a GPU) runs the same contract: it moved
    micro-batches with dict.items()."""
    torch.manual_seed(0)
    model = Blocks(d=64)
    ref = copy.deepcopy(model)
    batches = [(torch.randn(8, 256, 64, generator=torch.Generator().manual_seed(i)),
                torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(i))) for i in range(2)]

    def loss_fn(out, b):
        return F.cross_entropy(out.mean(1), b[1])

    wrapped = memopt.wrap(model, budget="16GB", sample=batches[0], hardware="h100_80gb", device="cpu",
                          use_cache=False, loss_fn=loss_fn, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                          pins={"precision": "fp32"}, autotune=True, guard=False)
    got = [wrapped.step(b) for b in batches]
    assert len(wrapped.autotune_trials) >= 2
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = losses_of_plain_loop(ref, batches, lambda m, b: loss_fn(m(b[0]), b), opt)
    assert got == pytest.approx(want, rel=1e-5)


def test_plan_and_profile_take_a_training_step():
    torch.manual_seed(0)
    x, y = _xy(8)

    def step(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    plan = memopt.plan(Blocks(), (x, y), budget="4GB", hardware="h100_80gb", training_step=step, use_cache=False)
    assert plan.fits and plan.global_batch == 8
    prof = memopt.profile(Blocks(), (x, y), hardware="h100_80gb", training_step=step, use_cache=False)
    assert prof.sample["batch_size"] == 8


def test_a_tuple_the_model_cannot_take_whole_says_to_pass_a_loss():
    with pytest.raises(ValueError, match=r"does not take the batch's 2 elements: for an \(inputs\.\.\., target\)"):
        memopt.wrap(Blocks(), budget="4GB", sample=_xy(), hardware="h100_80gb", device="cpu", use_cache=False)


class TakesTheTarget(nn.Module):
    """forward(x, y): a model that computes its own loss from the target."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Blocks()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.inner(x), y)


def test_a_target_held_back_from_a_forward_that_needs_it_says_how_to_pass_it():
    """With loss_fn, an (inputs..., target) tuple keeps its last element from the model: a forward that needs it is
    told how to get it (it was 'the model's step fails as fp32/...: missing 1 required positional argument')."""
    with pytest.raises(ValueError, match=r"TakesTheTarget\.forward does not take the 1 input\(s\) of the "
                                         r"\(inputs\.\.\., target\) batch.*training_step"):
        memopt.plan(TakesTheTarget(), _xy(8), budget="4GB", hardware="h100_80gb", use_cache=False,
                    loss_fn=lambda out, b: out)
    plan = memopt.plan(TakesTheTarget(), _xy(8), budget="4GB", hardware="h100_80gb", use_cache=False,
                       training_step=lambda m, b: m(*b))
    assert plan.fits


def test_a_training_step_may_return_a_dict_with_the_loss_as_lightning_does():
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    ref, model = Blocks(), copy.deepcopy(Blocks())
    model.load_state_dict(ref.state_dict())
    want = _reference(ref, [(x, y)] * 3, lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    w = _wrap(model, (x, y), 4, training_step=lambda m, b: {"loss": F.cross_entropy(m(b[0]), b[1]), "acc": 0.5})
    got = [w.step((x, y)) for _ in range(3)]
    _assert_same(w, ref, got, want)


@pytest.mark.parametrize("returned, message", [
    (lambda out: {"acc": out.mean()}, "a dict without a 'loss' entry"),
    (lambda out: F.cross_entropy(out, torch.zeros(len(out), dtype=torch.long), reduction="none"), "not one number"),
    (lambda out: 1.0, "returned a float"),
])
def test_a_loss_that_is_not_one_number_is_one_line(returned, message):
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    with pytest.raises(ValueError, match=message):  # at the plan's trace of the step, before anything trains
        _wrap(Blocks(), (x, y), 8, loss_fn=lambda out, b: returned(out))


class TakesTheDict(Blocks):
    """forward(batch) reads its inputs from the dict itself (a Lightning-style module) and returns the loss."""

    def forward(self, batch: dict) -> torch.Tensor:  # type: ignore[override]
        return F.cross_entropy(super().forward(batch["features"]), batch["target"])


@pytest.mark.parametrize("micro", [8, 4])
def test_a_forward_that_takes_the_whole_dict_is_called_with_it(micro):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    batches = [{"features": torch.randn(8, 16, generator=g), "target": torch.randint(0, 5, (8,), generator=g)}
               for _ in range(3)]
    ref = TakesTheDict()
    model = copy.deepcopy(ref)
    want = _reference(ref, batches, lambda m, b: m(b))
    w = _wrap(model, batches[0], micro)
    got = [w.step(b) for b in batches]
    _assert_same(w, ref, got, want)
    # a forward with one parameter named after a key still gets the keys
    assert not takes_the_whole_dict(nn.Linear(2, 2), {"input": torch.zeros(1, 2)})


@pytest.mark.parametrize("task_type, chunked_ce", [(None, 0), ("CAUSAL_LM", 0), (None, 4)])
def test_a_model_the_user_gave_lora_adapters_with_peft_trains_as_the_unwrapped_loop(task_type, chunked_ce):
    """``get_peft_model`` without a task type returns a ``PeftModel`` whose ``forward(*args, **kwargs)`` names no
    key of the batch: its base model's signature decides what the batch passes. Its head is the inner model's, so
    the chunked loss is exact on it too."""
    peft = pytest.importorskip("peft")
    from memopt.models import build_model

    def lora() -> nn.Module:
        torch.manual_seed(0)
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type=task_type,
                                 init_lora_weights=False)  # adapters that change the output from the first step
        return peft.get_peft_model(build_model("tiny_llama", device="cpu"), config)

    g = torch.Generator().manual_seed(3)
    batches = [{"input_ids": (ids := torch.randint(0, 200, (4, 16), generator=g)), "labels": ids,
                "source": torch.zeros(4)} for _ in range(3)]  # a key forward does not take
    ref = lora()
    want = _reference(ref, batches, lambda m, b: m(input_ids=b["input_ids"], labels=b["labels"]).loss)
    model = lora()
    assert not any("chunked cross-entropy refused" in n for n in memopt.plan(
        lora(), batches[0], budget="4GB", hardware="h100_80gb", use_cache=False).notes)
    w = memopt.wrap(model, budget="4GB", sample=batches[0], hardware="h100_80gb", device="cpu", use_cache=False,
                    pins={"micro_batch_size": 2, "precision": "fp32", "chunked_ce": chunked_ce},
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    got = [w.step(b) for b in batches]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


class ReturnsLossOfShapeOne(Blocks):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.cross_entropy(super().forward(x), y).reshape(1)


def test_a_model_output_that_is_not_a_loss_is_named_by_its_shape_and_the_fix_works():
    """A one-element output may be a loss kept 1-d or a prediction of one sample: memopt does not guess; the line
    says the shape (not torch's FakeTensor) and what to pass, and that works."""
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    with pytest.raises(ValueError, match=r"^the model returned a tensor of shape \(1,\), not a loss .*"
                                         r"loss_fn=lambda out, b: out\)"):
        _wrap(ReturnsLossOfShapeOne(), {"x": x, "y": y}, 8)
    w = _wrap(ReturnsLossOfShapeOne(), {"x": x, "y": y}, 4, loss_fn=lambda out, b: out)
    assert w.step({"x": x, "y": y}) > 0


class Graph(nn.Module):
    """A graph layer over a whole graph: node features (nodes, d) and an edge index (2, edges)."""

    def __init__(self, d: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(3)])
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = torch.tanh(layer(x))
            x = x + torch.zeros_like(h).index_add_(0, edge_index[1], h[edge_index[0]])
        return self.head(x)


def _graph(nodes: int, edges: int, seed: int = 0, d: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(nodes, d, generator=g), "edge_index": torch.randint(0, nodes, (2, edges), generator=g),
            "y": torch.randint(0, 5, (nodes,), generator=g)}


def _node_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(b["x"], b["edge_index"]), b["y"])


def test_a_graph_batch_whose_tensors_disagree_on_dim_0_is_one_sample_trained_whole():
    """Node features beside a (2, edges) index: no dim 0 holds samples, so the batch is planned and trained whole
    (the plan says why), as the unwrapped loop trains it; checkpointing still applies to its blocks."""
    torch.manual_seed(0)
    model = Graph()
    ref = copy.deepcopy(model)
    batches = [_graph(10, 30, seed=i) for i in range(3)]
    assert indivisible(batches[0]) and batch_size(batches[0]) == 1
    assert B.split(batches[0], 1) == [batches[0]]
    with pytest.raises(ValueError, match=r"disagree on dim 0.*cannot be shared over 2 ranks"):
        B.shard(batches[0], 0, 2)
    wrapped = memopt.wrap(model, budget="4GB", sample=batches[0], hardware="h100_80gb", device="cpu",
                          use_cache=False, pins={"precision": "fp32", "checkpointing": "full"},
                          optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2), training_step=_node_loss)
    assert wrapped.plan.global_batch == 1 and wrapped.plan.strategy.micro_batch_size == 1
    assert any("disagree on dim 0" in n and "trained whole" in n for n in wrapped.plan.notes)
    got = [wrapped.step(b) for b in batches]
    _assert_same(wrapped, ref, got, _reference(ref, batches, _node_loss))
    with pytest.warns(UserWarning, match=r"larger per sample.*x \(14, 16\) \(planned per sample \(10, 16\)\)"):
        wrapped.step(_graph(14, 30))  # a larger graph is a larger sample: more memory than planned


def test_a_graph_batch_is_estimated_as_its_simulation():
    """The profile traces the whole graph (every fake batch is the whole one): its estimate equals the simulated
    step of that batch."""
    from memopt.profile.cuda_semantics import kernel_policy_for
    from memopt.profile.simulate import simulate_step
    from memopt.strategy import Strategy

    model, sample = Graph(d=64), _graph(300, 2000, d=64)
    prof = memopt.profile(model, sample, hardware="h100_80gb", training_step=_node_loss, use_cache=False)
    strategy = Strategy(precision="fp32", micro_batch_size=1, grad_accum_steps=1)
    est = memopt.estimate(prof, strategy, num_steps=2)
    sim = simulate_step(model, lambda d: B.to_device(sample, d), strategy, loss_fn=B.TrainingStep(_node_loss),
                        policy=kernel_policy_for(memopt.load_hardware("h100_80gb")), num_steps=2)
    assert est.peak_allocated_bytes == pytest.approx(sim.peak_allocated_bytes, rel=0.01)


class Detector(nn.Module):
    """forward(images, targets) -> the loss: one box per image regressed onto each of that image's boxes, the
    torchvision detection interface (a list of per-image target dicts, each with its own number of boxes)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=4, padding=1)
        self.box = nn.Linear(8, 4)

    def forward(self, images: torch.Tensor, targets: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        pred = self.box(self.conv(images).mean((2, 3)))
        return torch.stack([F.smooth_l1_loss(p.expand_as(t["boxes"]), t["boxes"]) for p, t in zip(pred, targets)
                            ]).mean()


def _detection(boxes: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(len(boxes), 3, 16, 16, generator=g),
            [{"boxes": torch.rand(n, 4, generator=g) * (i + 1), "labels": torch.randint(0, 3, (n,), generator=g)}
             for i, n in enumerate(boxes)])


@pytest.mark.parametrize("boxes", [[3, 1, 5, 2], [4, 4, 4, 4]], ids=["uneven", "as_many_as_images"])
def test_a_list_of_per_image_target_dicts_is_split_by_image(boxes):
    """Each image's dict goes with its image. With as many boxes per image as images, every tensor agreed on dim 0
    and a micro-batch took images 2-3 with the first two dicts cut to boxes 2-3: trained wrong, silently."""
    batches = [_detection(boxes, seed) for seed in range(3)]
    assert batch_size(batches[0]) == 4 and not indivisible(batches[0])
    halves = B.split(batches[0], 2)
    assert [len(h[1]) for h in halves] == [2, 2]
    assert torch.equal(halves[1][1][0]["boxes"], batches[0][1][2]["boxes"])
    torch.manual_seed(0)
    model = Detector()
    ref = copy.deepcopy(model)
    step = lambda m, b: m(b[0], b[1])  # noqa: E731
    wrapped = _wrap(model, batches[0], micro=2, training_step=step)
    got = [wrapped.step(b) for b in batches]
    _assert_same(wrapped, ref, got, _reference(ref, batches, step))
    assert wrapped.plan.strategy.micro_batch_size == 2
