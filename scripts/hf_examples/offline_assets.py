"""Everything the example scripts would download, made here: text, translation pairs and an image folder, a
tokenizer trained on that text, tiny (or real-sized) models built from configs with random weights, an image
processor, and the two ``evaluate`` metrics the scripts load at start-up (``accuracy``, ``sacrebleu``).

``evaluate.load("accuracy")`` looks for ``./accuracy/accuracy.py`` before it asks the Hub, so the scripts run
from the assets folder find the metric modules written here. They are only computed under ``--do_eval`` /
``--predict_with_generate``, which the benchmark does not pass; they are real metrics all the same.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SIZES", "Size", "make_assets"]

SPECIAL = ["<pad>", "</s>", "<unk>", "<s>"]  # ids 0..3: T5's pad/eos/unk, then a bos for the causal LM


@dataclass(frozen=True)
class Size:
    name: str
    text_lines: int
    pairs: int
    images: int
    image_file_px: int  # the files' side; the processor resizes to image_px
    image_px: int
    vocab: int
    llama: dict
    t5: dict
    vit: dict


SIZES = {
    "tiny": Size("tiny", text_lines=1500, pairs=400, images=96, image_file_px=32, image_px=32, vocab=384,
                 llama={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256},
                 t5={"d_model": 64, "d_ff": 128, "d_kv": 16, "num_layers": 2, "num_decoder_layers": 2,
                     "num_heads": 4},
                 vit={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                      "patch_size": 8}),
    # a 1.2B Llama (TinyLlama's layers, our 8000-token vocabulary), t5-base's shape, ViT-base/16 at 224 px
    "real": Size("real", text_lines=60000, pairs=12000, images=1536, image_file_px=64, image_px=224, vocab=8000,
                 llama={"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                        "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048},
                 t5={"d_model": 768, "d_ff": 3072, "d_kv": 64, "num_layers": 12, "num_decoder_layers": 12,
                     "num_heads": 12},
                 vit={"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                      "num_attention_heads": 12, "patch_size": 16}),
}

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "do", "fi", "gu", "ha", "je", "wo"]


def _words(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n)]


def _sentences(rng: random.Random, lexicon: list[str], count: int) -> list[str]:
    # a Zipf-like word choice and a loose grammar, so that a language model has something to learn
    weights = [1.0 / (i + 1) for i in range(len(lexicon))]
    out = []
    for _ in range(count):
        words = rng.choices(lexicon, weights=weights, k=rng.randint(6, 18))
        out.append(" ".join(words).capitalize() + rng.choice([".", ".", "?", "!"]))
    return out


def _tokenizer(texts: list[str], vocab: int, dest: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   bos_token="<s>", model_max_length=4096)
    fast.save_pretrained(dest)


_ACCURACY = '''"""Accuracy: the share of predictions equal to their reference."""
import datasets
import evaluate


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(description="accuracy", citation="", inputs_description="",
                                   features=datasets.Features({"predictions": datasets.Value("int32"),
                                                               "references": datasets.Value("int32")}))

    def _compute(self, predictions, references):
        return {"accuracy": sum(int(p == r) for p, r in zip(predictions, references)) / max(1, len(references))}
'''

_SACREBLEU = '''"""Corpus BLEU through the sacrebleu package."""
import datasets
import evaluate


class Sacrebleu(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(description="sacrebleu", citation="", inputs_description="",
                                   features=datasets.Features({
                                       "predictions": datasets.Value("string"),
                                       "references": datasets.Sequence(datasets.Value("string"))}))

    def _compute(self, predictions, references):
        import sacrebleu

        return {"score": sacrebleu.corpus_bleu(predictions, [list(r) for r in zip(*references)]).score}
'''


def _images(rng: random.Random, size: Size, dest: Path) -> None:
    from PIL import Image, ImageDraw

    classes = {"circle": (200, 60, 60), "square": (60, 200, 60), "cross": (60, 60, 200)}
    px = size.image_file_px
    for i in range(size.images):
        name = list(classes)[i % len(classes)]
        color = classes[name]
        img = Image.new("RGB", (px, px), tuple(rng.randint(0, 90) for _ in range(3)))
        draw = ImageDraw.Draw(img)
        a, b = rng.randint(0, px // 4), rng.randint(px // 2, px - 1)
        jitter = tuple(min(255, c + rng.randint(-40, 40)) for c in color)
        if name == "circle":
            draw.ellipse((a, a, b, b), fill=jitter)
        elif name == "square":
            draw.rectangle((a, a, b, b), fill=jitter)
        else:
            draw.line((a, a, b, b), fill=jitter, width=max(2, px // 8))
            draw.line((a, b, b, a), fill=jitter, width=max(2, px // 8))
        folder = dest / name
        folder.mkdir(parents=True, exist_ok=True)
        img.save(folder / f"{i:05d}.png")


def _models(size: Size, root: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    # no dropout: micro-batches draw their masks in another order than one whole batch (as the Trainer's own
    # gradient accumulation does), and the losses are compared number for number (Llama and ViT have none)
    t5 = transformers.T5Config(vocab_size=size.vocab, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                               dropout_rate=0.0, **size.t5)
    transformers.T5ForConditionalGeneration(t5).save_pretrained(root / "t5")
    transformers.AutoTokenizer.from_pretrained(root / "tokenizer").save_pretrained(root / "t5")
    torch.manual_seed(0)
    labels = ["circle", "cross", "square"]  # the imagefolder loader sorts the class folders
    vit = transformers.ViTConfig(image_size=size.image_px, num_labels=len(labels),
                                 id2label={str(i): n for i, n in enumerate(labels)},
                                 label2id={n: str(i) for i, n in enumerate(labels)}, **size.vit)
    transformers.ViTForImageClassification(vit).save_pretrained(root / "vit")
    transformers.ViTImageProcessor(size={"height": size.image_px, "width": size.image_px}).save_pretrained(
        root / "vit")


def llama_overrides(size: Size) -> str:
    """``--config_overrides`` for run_clm's ``--model_type llama`` (built from the config, random weights)."""
    values = {**size.llama, "vocab_size": size.vocab, "bos_token_id": 3, "eos_token_id": 1}
    return ",".join(f"{k}={v}" for k, v in values.items())


def make_assets(root: Path, size: Size) -> Path:
    """Data, tokenizer, models and metrics for ``size`` under ``root`` (made once; a marker file says done)."""
    done = root / "done.json"
    if done.exists() and json.loads(done.read_text()).get("size") == size.name:
        return root
    rng = random.Random(1234)
    lexicon = _words(rng, 600)
    root.mkdir(parents=True, exist_ok=True)
    text = _sentences(rng, lexicon, size.text_lines)
    (root / "train.txt").write_text("\n".join(text) + "\n")
    with (root / "pairs.json").open("w") as f:
        for src in _sentences(rng, lexicon, size.pairs):
            # the "translation": every word reversed, and the word order too
            tgt = " ".join(w[::-1] for w in src.rstrip(".?!").lower().split()[::-1]) + src[-1]
            f.write(json.dumps({"translation": {"en": src, "de": tgt}}) + "\n")
    _images(rng, size, root / "images" / "train")
    _tokenizer(text, size.vocab, root / "tokenizer")
    _models(size, root)
    for name, body in (("accuracy", _ACCURACY), ("sacrebleu", _SACREBLEU)):
        (root / name).mkdir(exist_ok=True)
        (root / name / f"{name}.py").write_text(body)
    done.write_text(json.dumps({"size": size.name}))
    return root
