"""memopt.wrap(trainer) on Trainers built the way transformers' example scripts build them (what
scripts/hf_examples runs against the real scripts, which CI cannot run): run_translation's Seq2SeqTrainer (T5,
DataCollatorForSeq2Seq padding each batch, a tokenizer as processing_class) and run_image_classification's Trainer
(ViT, pixel_values through the script's own collate_fn, remove_unused_columns=False, an image processor as
processing_class). With micro-batches and checkpointing of one block per stack pinned, the wrapped Trainer trains
to the parameters of the plain one, and what ran is what the plan said."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import memopt  # noqa: E402 -- after the importorskips

STEPS = 3
PINS = {"precision": "fp32", "optimizer": "adamw_fused", "micro_batch_size": 2, "checkpointing": "full",
        "checkpoint_blocks": 1}


def _tokenizer():
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                                unk_token="<unk>")


def _pairs(n: int = 24) -> list[dict[str, list[int]]]:
    """Tokenized rows of uneven lengths, as run_translation's preprocess_function leaves them (no padding)."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(n):
        src, tgt = (int(torch.randint(3, 12, (1,), generator=g)) for _ in range(2))
        rows.append({"input_ids": [*torch.randint(3, 64, (src,), generator=g).tolist(), 1],
                     "attention_mask": [1] * (src + 1),
                     "labels": [*torch.randint(3, 64, (tgt,), generator=g).tolist(), 1]})
    return rows


def _t5():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                                   decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def _seq2seq_trainer(tmp_path):
    model, tokenizer = _t5(), _tokenizer()
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=STEPS, learning_rate=1e-3,
        report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True)
    collator = transformers.DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    return transformers.Seq2SeqTrainer(model=model, args=args, train_dataset=_pairs(), processing_class=tokenizer,
                                       data_collator=collator)


class _Images(torch.utils.data.Dataset):
    """Samples as the image script's ``set_transform`` gives them: the image's tensor and an integer label."""

    def __init__(self, n: int = 24) -> None:
        g = torch.Generator().manual_seed(4)
        self.x = torch.randn(n, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"pixel_values": self.x[i], "label": int(self.y[i])}


def _collate_fn(examples):  # run_image_classification's collate_fn
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    labels = torch.tensor([example["label"] for example in examples])
    return {"pixel_values": pixel_values, "labels": labels}


def _image_trainer(tmp_path):
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=3, num_attention_heads=4, num_labels=3)
    model = transformers.ViTForImageClassification(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=STEPS, learning_rate=1e-3,
        remove_unused_columns=False, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, seed=0,
        disable_tqdm=True)
    processor = transformers.ViTImageProcessor(size={"height": 16, "width": 16})
    return transformers.Trainer(model=model, args=args, train_dataset=_Images(), processing_class=processor,
                                data_collator=_collate_fn)


def _linear_calls(model: torch.nn.Module) -> dict[str, list[int]]:
    """Per block of each stack: how often its first linear layer ran (twice per forward when checkpointed)."""
    from memopt.blocks import find_block_stacks

    counts: dict[str, list[int]] = {}
    for stack in find_block_stacks(model):
        counts[stack.path] = [0] * len(stack)
        for i, block in enumerate(stack.blocks):
            linear = next(m for m in block.modules() if isinstance(m, torch.nn.Linear))
            def count(module, _args, p=stack.path, i=i):
                counts[p][i] += module.training  # training forwards (and their recomputation) only

            linear.register_forward_pre_hook(count)
    return counts


def _batches_seen(model: torch.nn.Module) -> list[int]:
    seen: list[int] = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(next(v for v in kwargs.values() if torch.is_tensor(v)).shape[0])
        if m.training else None, with_kwargs=True)
    return seen


@pytest.mark.parametrize("make", [pytest.param(_seq2seq_trainer, id="seq2seq_t5", marks=pytest.mark.slow),
                                  pytest.param(_image_trainer, id="image_vit")])
def test_example_script_trainer_wrapped_with_micro_batches_and_partial_checkpointing_trains_the_same(tmp_path, make):
    plain = make(tmp_path / "plain")
    plain.train()
    trainer = make(tmp_path / "memopt")
    wrapped = memopt.wrap(trainer, budget="4GB", hardware="h200", pins=PINS)
    s = wrapped.memopt_plan.strategy
    assert (s.micro_batch_size, s.grad_accum_steps, s.checkpointing.num_blocks) == (2, 4, 1)
    calls, seen = _linear_calls(wrapped.model), _batches_seen(wrapped.model)
    wrapped.train()
    assert seen == [2] * (4 * STEPS)  # the plan's micro-batches ran, inside each Trainer step
    for path, per_block in calls.items():  # one block of each stack recomputed in backward (the middle one)
        n = len(per_block)
        expected = [2 * 4 * STEPS if i in s.checkpointing.blocks(n) else 4 * STEPS for i in range(n)]
        assert per_block == expected, (path, per_block)
    losses = [r["loss"] for r in wrapped.state.log_history if "loss" in r]
    plain_losses = [r["loss"] for r in plain.state.log_history if "loss" in r]
    assert len(losses) == STEPS and losses == pytest.approx(plain_losses, rel=1e-5)
    # AdamW normalizes each gradient: float-summation noise on a near-zero gradient moves its weight by far more
    # than the noise (bounded by lr per step); 2e-5 is well under the 3e-3 three steps of lr 1e-3 can move one
    for name, value in plain.model.named_parameters():
        torch.testing.assert_close(wrapped.model.get_parameter(name), value, rtol=1e-4, atol=2e-5)


class _AugmentedImages(_Images):
    """A random augmentation drawn from the global RNG as each sample is read, as run_image_classification's
    RandomResizedCrop and RandomHorizontalFlip do."""

    def __getitem__(self, i: int) -> dict[str, object]:
        row = super().__getitem__(i)
        flip = bool(torch.rand(()) < 0.5)
        pixels = row["pixel_values"].flip(-1) if flip else row["pixel_values"]
        return {**row, "pixel_values": pixels + 0.1 * torch.randn_like(pixels)}


def test_wrap_leaves_the_scripts_random_stream_as_it_was(tmp_path):
    """Planning reads samples of the dataset (their augmentations draw random numbers) and traces the model; the
    script's augmentations and dropout after wrap must draw what they would have drawn without memopt."""
    def make(path):
        trainer = _image_trainer(path)
        trainer.train_dataset = _AugmentedImages()
        torch.manual_seed(7)  # the script's seed, set before the Trainer is built
        return trainer

    plain = make(tmp_path / "plain")
    plain.train()
    trainer = make(tmp_path / "memopt")
    expected = torch.random.get_rng_state()
    pins = {"precision": "fp32", "optimizer": "adamw_fused", "micro_batch_size": 8, "checkpointing": "none"}
    wrapped = memopt.wrap(trainer, budget="4GB", hardware="h200", pins=pins)
    assert torch.equal(torch.random.get_rng_state(), expected)
    wrapped.train()
    for name, value in plain.model.named_parameters():
        torch.testing.assert_close(wrapped.model.get_parameter(name), value, rtol=1e-5, atol=1e-7)


def test_whether_a_models_loss_divides_by_num_items_in_batch_is_asked_of_the_model(tmp_path):
    """Across processes the Trainer's token count spans every process, and memopt keeps it for a model whose loss
    divides by it; the Trainer assumes so of any forward taking **kwargs, which T5's mean loss does not."""
    from memopt.integrations.trainer_recovery import MicroBatchedTrainingStep

    trainer = _seq2seq_trainer(tmp_path / "t5")
    batch = trainer.data_collator(_pairs(4))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for model, inputs, expected in ((trainer.model, batch, False),
                                    (llama, {"input_ids": ids, "labels": ids}, True),
                                    # a collator's BatchEncoding (a UserDict, not a dict) is asked the same
                                    (llama, transformers.BatchEncoding({"input_ids": ids, "labels": ids}), True)):
        assert trainer.model_accepts_loss_kwargs  # what the Trainer believes of both
        model.train()
        step = MicroBatchedTrainingStep(trainer, plan=None)
        rng = torch.random.get_rng_state()
        assert step._loss_uses_num_items(model, inputs, torch.tensor(5)) is expected
        assert model.training and torch.equal(torch.random.get_rng_state(), rng)
