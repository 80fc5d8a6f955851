"""The rows of a real sample batch that the batches the profile makes stand in for: its masks (a collator's padding
takes other attention paths than a full row) and its token ids (a model may read their values), taken in turn into
each made batch of any size."""

from __future__ import annotations

from typing import Any

import torch

from memopt.step import batch_tree

__all__ = ["IDS", "MASKS", "real_rows", "with_real_rows"]

#: the masks of a real batch that ``make_batch`` (no mask: an unpadded batch) would drop: a Trainer's collator pads
#: its batches and says where, and a loss of its own may read them (TRL's ``SFTTrainer.compute_loss`` needs one)
MASKS = {"attention_mask": "input_ids", "decoder_attention_mask": "decoder_input_ids"}
#: the token ids of a real batch, which the made batch's random ids stand for: a model reads their values (BART's
#: classification head pools each row at its last end-of-sequence token and checks that every row holds as many),
#: and random ids neither hold those tokens where the real ones do nor leave them out elsewhere
IDS = ("input_ids", "decoder_input_ids")


def real_rows(sample: Any) -> dict[str, torch.Tensor]:
    """The 2-d masks and token ids ``sample`` (a real dict batch) carries, on the CPU."""
    if not isinstance(sample, dict):
        return {}
    masks = {key: sample[key].detach().cpu() for key in MASKS
             if isinstance(sample.get(key), torch.Tensor) and sample[key].dim() == 2}
    ids = {key: sample[key].detach().cpu() for key in IDS
           if isinstance(sample.get(key), torch.Tensor) and sample[key].dim() == 2
           and not sample[key].is_floating_point() and sample[key].device.type != "meta"
           and not batch_tree.is_fake(sample[key])}
    return masks | ids


def with_real_rows(batch: dict[str, Any], rows: dict[str, torch.Tensor], b: int) -> dict[str, Any]:
    """``batch`` (``b`` samples made by ``make_batch``) with the real batch's masks and token ids, its rows taken in
    turn, where the mask's length is the length of the ids it masks (the decoder's ids: ``labels`` where none are
    made), and the real ids are shaped as the made ones."""
    for key, real in rows.items():
        if key in IDS:
            made = batch.get(key)
            if isinstance(made, torch.Tensor) and made.shape[1:] == real.shape[1:] and made.dtype == real.dtype:
                batch[key] = real[torch.arange(b) % real.shape[0]].to(made.device)
            continue
        ids = batch.get(MASKS[key], batch.get("labels") if key == "decoder_attention_mask" else None)
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == real.shape[1]:
            batch[key] = real[torch.arange(b) % real.shape[0]].to(ids.device)
    return batch
