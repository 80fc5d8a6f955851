"""memopt.wrap(trainer): a plan that checkpoints some blocks runs (memopt's checkpointing on the Trainer's model),
the plan's bf16 reaches the Trainer's accelerator (autocast active in training_step), the allocator mode in force
is planned for, and models that are not shape-sampled (GPT2LMHeadModel, sequence classifiers) plan from the
Trainer's own data."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import memopt
from memopt.models import build_model

SEQ = 16


def _data(n: int = 32, vocab: int = 256, labels: str = "tokens"):
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (SEQ,), generator=g)
        if labels == "tokens":
            y = ids.clone()
            y[: int(torch.randint(0, SEQ // 2, (1,), generator=g))] = -100
        else:
            y = torch.randint(0, 3, (), generator=g)
        rows.append({"input_ids": ids, "labels": y})
    return rows


def _trainer(tmp_path, model, data, *, steps: int = 3, per_device: int = 4, optim: str = "adamw_torch"):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=per_device,
                             gradient_accumulation_steps=1, max_steps=steps, learning_rate=1e-2,
                             lr_scheduler_type="constant", optim=optim, report_to=[], use_cpu=True,
                             save_strategy="no", logging_strategy="no", seed=0, data_seed=0, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=data)


def _llama():
    torch.manual_seed(0)
    return build_model(memopt.models.with_overrides("tiny_llama", {"num_hidden_layers": 4}), device="cpu")


PINS = {"precision": "fp32", "micro_batch_size": 2, "optimizer": "adamw"}


def _calls(module) -> list[int]:
    count = [0]
    # a pre-hook: recomputation stops early once the saved tensors are back, before the module returns; training
    # passes only (memopt's checks of the loss run in eval mode, through every block alike)
    module.register_forward_pre_hook(lambda m, _: count.__setitem__(0, count[0] + 1) if m.training else None)
    return count


def test_a_plan_checkpointing_some_blocks_runs_under_the_trainer_and_trains_the_same(tmp_path):
    # SGD: Adam's normalized update would turn float-summation noise in near-zero gradients into lr-sized steps
    plain = _trainer(tmp_path / "a", _llama(), _data(), optim="sgd")
    plain.train()
    trainer = _trainer(tmp_path / "b", _llama(), _data(), optim="sgd")
    wrapped = memopt.wrap(trainer, budget="4GB", hardware="h200",
                          pins={**PINS, "optimizer": "sgd", "checkpointing": "full", "checkpoint_blocks": 2})
    ckpt = wrapped.memopt_plan.strategy.checkpointing
    assert (ckpt.mode, ckpt.num_blocks) == ("full", 2)  # raised "the Trainer checkpoints every block or none"
    assert wrapped.args.gradient_checkpointing is False  # memopt checkpoints, not the Trainer's flag
    layers = wrapped.model.model.layers
    checkpointed = [i for i, b in enumerate(layers) if "forward" in b.__dict__]
    assert len(checkpointed) == 2
    mlp_calls = [_calls(b.mlp) for b in layers]
    wrapped.train()
    # a checkpointed block runs its forward again in backward: twice the calls of one that is not
    calls = [c[0] for c in mlp_calls]
    plain_block = next(i for i in range(len(layers)) if i not in checkpointed)
    assert all(calls[i] == 2 * calls[plain_block] for i in checkpointed) and calls[plain_block] > 0, (
        calls, checkpointed)
    for k, v in plain.model.named_parameters():
        torch.testing.assert_close(wrapped.model.get_parameter(k), v, rtol=1e-4, atol=1e-6)


def test_the_plans_bf16_reaches_the_accelerator_and_autocast_runs_in_training_step(tmp_path):
    trainer = _trainer(tmp_path, _llama(), _data(), steps=1)
    assert trainer.accelerator.mixed_precision == "no"  # built before wrap, from the arguments as they were
    wrapped = memopt.wrap(trainer, budget="4GB", hardware="h200", pins={**PINS, "precision": "bf16_autocast"})
    assert wrapped.args.bf16 and wrapped.accelerator.mixed_precision == "bf16"
    seen = []
    # training passes (memopt's checks of the loss run in eval mode, in fp32)
    wrapped.model.model.layers[0].register_forward_pre_hook(
        lambda m, _: seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        if m.training else None)
    wrapped.train()
    assert seen and all(s == (True, torch.bfloat16) for s in seen)


def test_fp32_plan_turns_a_trainers_bf16_off(tmp_path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, bf16=True,
                             report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no")
    trainer = Trainer(model=_llama(), args=args, train_dataset=_data())
    assert trainer.accelerator.mixed_precision == "bf16"
    wrapped = memopt.wrap(trainer, budget="4GB", hardware="h200", pins=PINS)
    assert not wrapped.args.bf16 and wrapped.accelerator.mixed_precision == "no"
    seen = []
    wrapped.model.model.layers[0].register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    wrapped.train()
    assert seen and not any(seen)


def test_the_allocator_mode_in_force_is_planned_for_with_a_warning(tmp_path, monkeypatch):
    """A model moved to the GPU before wrap fixes the allocator's segment mode: the plan is made for that mode."""
    import memopt.integrations.hf_trainer as hf

    monkeypatch.setattr(hf, "allocator_mode_in_force", lambda: False)
    trainer = _trainer(tmp_path, _llama(), _data(), steps=1)
    with pytest.warns(UserWarning, match="expandable_segments:False"):
        wrapped = memopt.wrap(trainer, budget="4GB", hardware="h200", pins=PINS)
    assert wrapped.memopt_plan.strategy.expandable_segments is False
    wrapped.train()


@pytest.mark.parametrize("kind", ["gpt2", "bert_classifier"])
def test_models_without_a_shape_sampler_plan_from_the_trainers_data(tmp_path, kind):
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=SEQ, eos_token_id=0, bos_token_id=0))
        data = _data()
    else:
        model = transformers.BertForSequenceClassification(transformers.BertConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=256,
            max_position_embeddings=SEQ, num_labels=3))
        data = _data(labels="classes")
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = _trainer(tmp_path, model, data, steps=2)
    wrapped = memopt.wrap(trainer, budget="4GB", hardware="h200", pins=PINS)  # raised "'batch_size' is a int"
    assert wrapped.memopt_plan.fits and wrapped.memopt_plan.global_batch == 4
    wrapped.train()
    assert any(not torch.equal(before[k], v) for k, v in wrapped.model.named_parameters())


def _rows(lengths: dict[int, tuple[int, int]], n: int, base: int = 8) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of ``base`` tokens; row i has (input, label) lengths ``lengths[i]`` where given."""
    return [{"input_ids": torch.full((lengths.get(i, (base, base))[0],), 5),
             "labels": torch.full((lengths.get(i, (base, base))[1],), 5)} for i in range(n)]


def test_the_trainer_is_planned_for_the_datasets_longest_row_wherever_it_is(tmp_path):
    """A Trainer shuffles: the longest row, far past the first few hundred, can come in any batch. The plan read
    the first 256 rows' lengths and a later, longer batch ran past it (a T5 translation run on the H200 ran out of
    memory under memopt's cap in its second epoch)."""
    from memopt.integrations.trainer_sample import ROWS_READ, row_length_ranges

    rows = _rows({700: (40, 8)}, 1000)
    assert row_length_ranges(rows, ("input_ids", "labels")) == {"input_ids": (8, 40), "labels": (8, 8)}
    trainer = _trainer(tmp_path, _llama(), rows, steps=1)
    wrapped = memopt.wrap(trainer, budget="4GB", hardware="h200", pins=PINS)
    assert wrapped.memopt_plan.model["sample"]["seq_len"] == 40
    # beyond ROWS_READ rows, a spread of rows over the whole dataset is read, its first and last included
    many = _rows({0: (12, 8), 3 * ROWS_READ - 1: (30, 50)}, 3 * ROWS_READ)
    assert row_length_ranges(many, ("input_ids", "labels")) == {"input_ids": (8, 30), "labels": (8, 50)}


def test_a_seq2seq_trainer_is_planned_for_its_longest_labels(tmp_path):
    torch.manual_seed(0)
    model = build_model(memopt.models.with_overrides("tiny_t5", {"num_layers": 2, "num_decoder_layers": 2}),
                        device="cpu")
    trainer = _trainer(tmp_path, model, _rows({300: (10, 24)}, 400), steps=1)
    wrapped = memopt.wrap(trainer, budget="4GB", hardware="h200", pins=PINS)
    sample = wrapped.memopt_plan.model["sample"]
    assert (sample["seq_len"], sample["decoder_seq_len"]) == (10, 24)


def test_planning_for_a_trainer_shows_its_progress(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMOPT_PROGRESS", "1")
    trainer = _trainer(tmp_path, _llama(), _data(), steps=1)
    # no cache: a profile another test left there would be read, not traced (no "traced" lines)
    wrapped = memopt.wrap(trainer, budget="4GB", hardware="h200", pins=PINS, use_cache=False)
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().err.splitlines() if line.startswith("memopt [")]
    assert lines[0].startswith("profiling LlamaForCausalLM for the Trainer")
    assert any(x.startswith("traced ") for x in lines)
    assert lines[-1].startswith(f"planned: {wrapped.memopt_plan.strategy.label()} (predicted ")


def _padded_data(n: int = 32, vocab: int = 256) -> list[dict[str, torch.Tensor]]:
    """Rows padded to SEQ with an attention mask, as a collator that pads makes them (TRL's SFT data)."""
    g = torch.Generator().manual_seed(2)
    rows = []
    for i in range(n):
        length = SEQ if i % 4 == 0 else int(torch.randint(SEQ // 2, SEQ, (1,), generator=g))
        ids = torch.randint(3, vocab, (SEQ,), generator=g)
        mask = (torch.arange(SEQ) < length).long()
        ids[length:] = 0
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def _mask_reading_trainer(tmp_path, *, bf16: bool):
    """A Trainer whose own ``compute_loss`` needs the collator's ``attention_mask`` (as TRL's ``SFTTrainer``'s does:
    "Expected 'attention_mask' or 'position_ids' in inputs") and whose arguments ask for bf16 autocast."""
    from transformers import Trainer, TrainingArguments

    class MaskReadingTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if "attention_mask" not in inputs:
                raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=3,
                             learning_rate=1e-2, lr_scheduler_type="constant", report_to=[], use_cpu=True,
                             save_strategy="no", logging_steps=1, seed=0, data_seed=0, disable_tqdm=True,
                             bf16=bf16)
    return MaskReadingTrainer(model=_llama(), args=args, train_dataset=_padded_data())


@pytest.mark.parametrize("bf16", [True, False])
def test_a_trainer_whose_loss_reads_the_collators_masks_is_planned_from_its_data_in_its_precision(tmp_path, bf16):
    """Planned from the Trainer's own collated batch (its attention mask, padding included), not from shapes, and in
    the precision its arguments ask for: the same losses and parameters as the script without memopt. It raised
    the loss's own error while tracing, and the plan's fp32 replaced the script's bf16."""
    plain = _mask_reading_trainer(tmp_path / "a", bf16=bf16)
    plain.train()
    # fp32 arguments leave the precision to the plan (bf16 under the default fidelity): pinned here to compare
    wrapped = memopt.wrap(_mask_reading_trainer(tmp_path / "b", bf16=bf16), budget="4GB", hardware="h200",
                          pins=None if bf16 else {"precision": "fp32"})
    assert wrapped.memopt_plan.strategy.precision == ("bf16_autocast" if bf16 else "fp32")
    assert wrapped.memopt_plan.strategy.micro_batch_size == 8  # the whole batch at once: bitwise comparable
    wrapped.train()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (plain, wrapped)]
    assert losses[0] == losses[1] and len(losses[0]) == 3
    for k, v in plain.model.named_parameters():
        torch.testing.assert_close(wrapped.model.get_parameter(k), v, rtol=0, atol=0)


def test_the_collated_sample_of_rows_of_several_lengths_is_padded_where_a_micro_batch_of_two_sees_it(tmp_path):
    """The longest row first (a micro-batch of one is never padded), the shortest second: a padded batch builds an
    attention mask that an unpadded one does not, so the plan must trace one."""
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorWithPadding, PreTrainedTokenizerFast

    from memopt.integrations.trainer_sample import collated_batch

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "a": 1}, "<pad>")),
                                  pad_token="<pad>")
    rows = [{"input_ids": [1] * n, "attention_mask": [1] * n} for n in (5, 9, 3, 7, 9, 4)]
    trainer = _mask_reading_trainer(tmp_path, bf16=False)
    trainer.data_collator = DataCollatorWithPadding(tok)
    batch = collated_batch(trainer, rows, 4)
    assert batch["input_ids"].shape == (4, 9)
    assert batch["attention_mask"].sum(1).tolist()[:2] == [9, 3]


def test_a_scripts_fp16_that_the_fidelity_does_not_allow_is_named_and_the_plan_chooses(tmp_path):
    """fp16 autocast needs fidelity='mixed': under the default fidelity the script's fp16 is not kept silently."""
    trainer = _trainer(tmp_path, _llama(), _data(), steps=1)
    trainer.args.fp16 = True  # as a GPU script sets it (the CPU Trainer refuses fp16 when it is built)
    with pytest.warns(UserWarning, match=r"ask for fp16_autocast, which the plan's fidelity does not allow.*"
                                         r"fidelity='mixed'"):
        wrapped = memopt.wrap(trainer, budget="4GB", hardware="h200")
    assert wrapped.memopt_plan.strategy.precision != "fp16_autocast" and wrapped.args.fp16 is False


def test_a_trainer_fed_rows_of_several_lengths_is_planned_from_its_padded_batches(tmp_path):
    """A padding collator makes masks that take another attention path than the unpadded batches shapes describe:
    such a Trainer is planned from its own collated batch (the prediction of ``memopt.plan`` on that batch, not
    the one on shapes), and trains as the script does."""
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerFast

    from memopt.integrations.trainer_sample import collated_batch

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "a": 1}, "<pad>")),
                                  pad_token="<pad>")
    g = torch.Generator().manual_seed(3)
    rows = []
    for n in [64, 20, 33, 64, 47, 12, 58, 30] * 4:
        ids = torch.randint(3, 256, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * n, "labels": ids})

    def trainer(path):
        # SGD: Adam's normalized update would turn float-summation noise in near-zero gradients into lr-sized steps
        t = _trainer(path, _llama(), rows, steps=2, per_device=8, optim="sgd")
        t.data_collator = DataCollatorForSeq2Seq(tok, label_pad_token_id=-100)
        return t

    pins = {**PINS, "optimizer": "sgd"}
    plain = trainer(tmp_path / "a")
    plain.train()
    wrapped = memopt.wrap(trainer(tmp_path / "b"), budget="4GB", hardware="h200", pins=pins)
    padded = collated_batch(wrapped, rows, 8)
    assert (padded["attention_mask"] == 0).any()
    on_batch = memopt.plan(_llama(), padded, budget="4GB", hardware="h200", pins=pins)
    on_shapes = memopt.plan(_llama(), {"batch_size": 8, "seq_len": 64}, budget="4GB", hardware="h200", pins=pins)
    assert wrapped.memopt_plan.prediction == on_batch.prediction != on_shapes.prediction
    wrapped.train()
    for k, v in plain.model.named_parameters():
        torch.testing.assert_close(wrapped.model.get_parameter(k), v, rtol=1e-4, atol=1e-6)


def test_a_collator_that_packs_its_rows_keeps_the_trainers_batch_of_rows(tmp_path):
    """DataCollatorWithFlattening joins a batch's rows into one (padding-free): taken as it comes, the sample had
    one row, and the plan set the Trainer's per-device batch to 1, a different training. The Trainer is planned for
    its rows padded to the longest (at least the packed batch's memory), with a warning, and keeps its batch of
    rows; a Trainer whose own loss needs its collated batch is refused in one line."""
    from transformers import DataCollatorWithFlattening

    from memopt.integrations.trainer_sample import PackedRows, collated_batch

    g = torch.Generator().manual_seed(3)
    rows = []
    for n in [64, 20, 33, 64, 47, 12, 58, 30] * 4:
        ids = torch.randint(3, 256, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": ids})

    def trainer(path):
        t = _trainer(path, _llama(), rows, steps=2, per_device=8, optim="sgd")
        t.data_collator = DataCollatorWithFlattening()
        return t

    plain = trainer(tmp_path / "a")
    plain.train()
    with pytest.warns(UserWarning, match="joins the 8 rows it is given into 1.*padded to the longest"):
        wrapped = memopt.wrap(trainer(tmp_path / "b"), budget="4GB", hardware="h200",
                              pins={"precision": "fp32", "optimizer": "sgd"})
    assert wrapped.memopt_plan.global_batch == 8
    assert wrapped.args.per_device_train_batch_size * wrapped.args.gradient_accumulation_steps == 8
    wrapped.train()
    for k, v in plain.model.named_parameters():
        torch.testing.assert_close(wrapped.model.get_parameter(k), v, rtol=1e-4, atol=1e-6)
    with pytest.raises(PackedRows, match="padding-free packing"):
        collated_batch(trainer(tmp_path / "c"), rows, 8)
