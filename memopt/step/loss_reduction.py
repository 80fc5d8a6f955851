"""How the user's loss reduces over the samples of a batch, so that micro-batches accumulate the whole batch's
gradient.

Micro-batch ``i`` of ``n_i`` loss items (``memopt.step.batch.count_loss_items``) out of ``N`` is weighted by
``n_i / N`` when the loss is a **mean** over those items (the default of every torch loss and of Hugging Face's
models), and by 1 when it is a **sum** (``reduction="sum"``, an ELBO summed over samples, ``loss.sum()``): the same
weighting for both would scale a summed loss's gradient by ``1 / micro-batches``, silently. A loss that is neither
(in-batch negatives of a contrastive loss, a statistic of the whole batch) cannot be reproduced by any weighting of
micro-batches.

The user may say which (``memopt.wrap(..., loss_reduction="mean" | "sum")``). Left at ``"auto"``, the first step
that splits a batch measures it when the loss is the user's (a ``loss_fn``, a ``training_step``, or a model that is
not a Hugging Face model returning its own loss): the loss of ``k`` samples is compared with the loss of the same
``k`` samples given twice. A mean gives the same number, a sum twice it, and anything else couples the samples. A
mean is then checked against its weights: the micro-batch's loss must equal its two halves' losses weighted by their
loss items, or the mean is over items the batch's values select otherwise (a mask of the user's own), which no
weighting of micro-batches reproduces. The forwards (at most five) run without gradients (with them, kept off the
parameters, where the loss needs them: a gradient penalty), in eval mode (dropout off,
so duplicated samples give the same values), each on a copy of at most the micro-batch's own number of samples (two
for a micro-batch of one); the modules' training flags, the buffers and the random generators are put back as they
were, so training is unchanged by the check (the model's forward hooks do see its forwards).

A part whose loss is 0 (every item masked, a margin already met) tells nothing, so the next part is taken. Where the
halves' losses are too close to tell the labels' weights from those of a mask that leaves labelled positions out (a
fresh model's, every token's loss about the same), the split is refused rather than guessed; so is a Hugging Face
pre-training head's own loss (terms over different items), without measuring, and a CTC head's mean (each sample's
loss over its own target length, then over samples: weighted by samples, not labels). A loss that draws random
numbers even in eval mode (noise or timesteps a diffusion training step samples) gives the same samples another loss
each time, so no comparison can tell: it is accumulated as a mean, with a warning that names the draws.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memopt.models.hf_task import hf_task, is_hf_model, peft_unwrapped
from memopt.step import batch as _batch
from memopt.step.batch_samples import batch_size, record_ids, record_lists
from memopt.step.batch_tree import leaves, tree_map
from memopt.step.random_draws import DrawLog
from memopt.step.side_effects import side_effects_undone
from memopt.techniques.precision import forward_context

__all__ = ["REDUCTIONS", "LossNotSplittable", "LossReduction", "classify_reduction", "first_labelled",
           "measure_reduction", "micro_batch_weights", "own_ctc_mean", "own_loss_terms", "own_loss_unknown",
           "reduction_sample",
           "settle", "starting_mode"]

REDUCTIONS = ("auto", "mean", "sum")
# |ratio - 1| (mean) or |ratio - 2| / 2 (sum) within this: bf16 autocast at another batch size may pick other
# kernels, which moves a mean loss by well under a percent; a coupled loss moves by far more
_TOLERANCE = 0.05


class LossNotSplittable(ValueError):
    """The loss is neither a mean nor a sum over samples, so micro-batches cannot reproduce it."""


@dataclass
class LossReduction:
    """``mode``: "mean" or "sum", or "auto" until the first step that splits a batch measures it. One object is
    shared by every train step a wrapped model builds (the plan's, the autotune's candidates, the guard's re-plans),
    so what was measured once holds for all of them. ``shifted``: whether the loss shifts its token labels by one,
    once measured (``memopt.step.loss_items``); ``num_items``: whether it divides by a ``num_items_in_batch`` the
    batch carries, once measured."""

    mode: str = "mean"
    shifted: bool | None = None
    num_items: bool | None = None

    def __post_init__(self) -> None:
        check_reduction(self.mode)


def starting_mode(model: nn.Module, loss_fn: Any, requested: str) -> str:
    """The mode a wrapped model starts under: the own loss of a Hugging Face model with a task head is a mean over
    its tokens or samples, so "auto" needs no check there; any other loss (the user's, a contrastive model's, one
    with a router's load-balancing term) is measured at the first split batch."""
    check_reduction(requested)
    known = loss_fn is None and is_hf_model(model) and own_loss_unknown(model) is None
    return "mean" if requested == "auto" and known else requested


def own_loss_unknown(model: nn.Module) -> str | None:
    """Why a Hugging Face model's own loss is not known to be a mean over its loss items (None: it is, as every task
    head's cross-entropy is): a model without a task head memopt knows (CLIP's contrastive loss over in-batch
    negatives, a CTC loss), or a router's load-balancing loss added over the whole batch's tokens."""
    inner = peft_unwrapped(model)
    config = getattr(inner, "config", None)
    if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 1.0):
        return "its loss adds the router's load-balancing loss over every token of the batch (output_router_logits)"
    if hf_task(inner) is None:
        return f"{type(inner).__name__}'s own loss is not one memopt knows to be a mean over samples or tokens"
    return None


def own_loss_terms(model: nn.Module) -> str | None:
    """Why a Hugging Face model's own loss cannot be split into micro-batches by any weighting (None: nothing known
    against it). A pre-training head's loss adds terms averaged over different items (BERT's masked-LM mean over
    masked tokens plus its next-sentence mean over samples) or averages over the attention mask's tokens rather
    than the labelled ones (ELECTRA's replaced-token detection): at initialisation every sample's loss is about the
    same, so the measurement could not see it while the gradients already differ."""
    inner = peft_unwrapped(model)
    name = type(inner).__name__
    if is_hf_model(inner) and name.endswith("ForPreTraining"):
        return (f"{name}'s own pre-training loss adds terms averaged over different items (masked tokens, samples) "
                "or averages over the attention mask rather than the labels")
    return None


def own_ctc_mean(model: nn.Module) -> str | None:
    """Why a Hugging Face CTC head's own loss is not weighted as memopt weights micro-batches (None: it is, or the
    model has none): under ``ctc_loss_reduction="mean"`` each sample's loss is divided by its own target length
    before the mean over samples, so the exact weights are the samples, where memopt counts the labels other than
    -100. A batch whose targets are all as long cannot show it, so it is known rather than measured."""
    inner = peft_unwrapped(model)
    name = type(inner).__name__
    if is_hf_model(inner) and name.endswith("ForCTC") and \
            getattr(getattr(inner, "config", None), "ctc_loss_reduction", None) == "mean":
        return (f"{name}'s own CTC loss (config.ctc_loss_reduction='mean') divides each sample's loss by its target "
                "length before averaging over the samples")
    return None


def check_reduction(mode: Any) -> None:
    if mode not in REDUCTIONS:
        raise ValueError(f"loss_reduction={mode!r} is not one of {', '.join(map(repr, REDUCTIONS))}: say 'mean' for "
                         "a loss averaged over samples or tokens, 'sum' for one summed over them, or 'auto' to let "
                         "memopt measure it on the first batch")


def first_labelled(micro: list[Any], counts: list[int], default: Any = None) -> Any:
    """The first micro-batch that carries loss items (``counts``: each one's), else ``default``: a loss over none
    is 0/0, so checks and stand-ins use this one."""
    return next((mb for mb, n in zip(micro, counts) if n > 0), default)


def reduction_sample(micro: list[Any], counts: list[int], *, causal: bool = False) -> Any:
    """The micro-batch the reduction check runs on: as many samples as the first micro-batch (two at least), from
    the whole global batch, so that its two halves carry loss items as unequally as the batch allows (the samples
    with the most in one half, with the fewest, none if some have none, in the other). With equal counts a mean over
    items and a loss weighted otherwise (a term over every sample beside a mean over labelled ones) give the same
    number, and the check could not tell them apart. The first micro-batch with loss items where every sample
    carries as many, or where the micro-batches do not stack (cut to other lengths)."""
    default = first_labelled(micro, counts, micro[0])
    # two samples at least, so that it has halves to weigh: at micro-batch 1 the check's forward (without gradients)
    # takes less memory than the step's own forward of one sample, which keeps its activations for backward
    m = max(2, batch_size(micro[0]))
    if sum(batch_size(mb) for mb in micro) < m:
        return default
    if record_lists(micro[0]):  # per-sample records do not stack row by row
        return default
    columns = [[t for _, t in leaves(mb)] for mb in micro]
    if any(len(c) != len(columns[0]) or any(a.dim() != b.dim() or (a.dim() and a.shape[1:] != b.shape[1:])
                                            for a, b in zip(c, columns[0])) for c in columns):
        return default
    stacked = [torch.cat([c[i] for c in columns]) if columns[0][i].dim() else columns[0][i]
               for i in range(len(columns[0]))]
    whole = iter(stacked)
    glued = tree_map(lambda t: next(whole), micro[0])
    items = [_batch.count_loss_items(s, causal=causal) for s in _batch.split(glued, 1)]
    if len(set(items)) < 2:
        if batch_size(micro[0]) >= m:
            return default
        items = [0] * len(items)  # every sample alike: the first m, in order
    order = sorted(range(len(items)), key=lambda i: -items[i])
    half = m // 2
    chosen = torch.tensor(order[:half] + order[len(order) - (m - half):])
    picked = iter(stacked)
    return tree_map(lambda t: (lambda g: g.index_select(0, chosen.to(g.device)) if g.dim() else g)(next(picked)),
                    micro[0])


def micro_batch_weights(counts: list[int], mode: str, world_size: int = 1, total: float | None = None) -> list[float]:
    """The factor each micro-batch's loss is scaled by before its backward, so the accumulated gradient is the whole
    batch's. ``counts``: the loss items of this rank's micro-batches; ``total``: the global batch's (over every
    rank; default their sum). Data-parallel engines average gradients over ``world_size`` ranks, which the factor
    undoes."""
    if mode == "sum":
        return [float(world_size)] * len(counts)
    total = sum(counts) if total is None else total
    return [n * world_size / total for n in counts]


def classify_reduction(model: nn.Module, micro_batch: Any, loss_fn: Any, *, precision: str,
                       device_type: str, causal: bool = False) -> tuple[str, str]:
    """(verdict, why): how the loss of ``micro_batch`` (on the device) reduces over its samples. The verdict is
    "mean", "sum", "coupled" (neither: ``why`` says what was measured), "masked" (a mean, but not over the items
    memopt weights micro-batches by: :func:`_weighting_mismatch`), "terms" (a model's own loss known to add terms
    no weighting reproduces: :func:`own_loss_terms`; nothing is measured), "per_sample" (a CTC head's mean over
    samples of per-sample means: :func:`own_ctc_mean`; nothing is measured) or "unknown" (the check cannot tell: the
    loss is 0 on every part it tried or not finite, or the forward fails in eval mode). ``causal``: the labels are
    shifted inside the model."""
    terms = own_loss_terms(model) if loss_fn is None else None
    if terms is not None:
        return "terms", terms
    per_sample = own_ctc_mean(model) if loss_fn is None else None
    if per_sample is not None:
        return "per_sample", per_sample
    m = batch_size(micro_batch)
    parts = _batch.split(micro_batch, max(1, m // 2))
    def measured(grad: bool) -> tuple[float, float, Any, set[str], str | None]:
        draws = DrawLog()
        with side_effects_undone(model, grad=grad), forward_context(precision, device_type):
            with draws:
                known: dict[int, float] = {}
                # the first part whose loss is not 0 (a sample with every item masked, a hinge already met): a
                # loss of 0 is 0 given once or twice, mean and sum alike
                for i, part in enumerate(parts[:2]):
                    known[i] = once = float(_loss_of_copy(model, part, loss_fn))
                    if abs(once) >= 1e-12 or not math.isfinite(once):
                        break
                head = parts[i]
                twice = tree_map(lambda t: torch.cat([t, t]) if t.dim() > 0 else t, head,
                                 records=lambda r: r + r, record_ids=record_ids(head))
                doubled = float(_loss_of_copy(model, twice, loss_fn))
            if draws.seen:
                return once, doubled, head, draws.seen, None
            mismatch = (_weighting_mismatch(model, micro_batch, parts, known, loss_fn, precision, causal)
                        if len(parts) == 2 and abs(doubled - once) <= _TOLERANCE * max(abs(once), abs(doubled))
                        else None)
        return once, doubled, head, set(), mismatch

    try:
        try:
            once, doubled, head, seen, mismatch = measured(grad=False)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as without:
            # a step that differentiates inside itself (a gradient penalty's autograd.grad) needs gradients even
            # to compute its loss: measured again with them, none left on the parameters
            try:
                once, doubled, head, seen, mismatch = measured(grad=True)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as within:  # a model whose eval forward differs: the check only informs
                first, second = (f"{type(e).__name__}: {e}" for e in (without, within))
                return "unknown", (f"its forward in eval mode failed: {first}" if first == second else
                                   f"its forward in eval mode failed without gradients ({first}) and with them "
                                   f"({second})")
        if seen:
            # the same samples meet other numbers in each forward: no comparison of losses can tell
            return "unknown", (f"its loss draws random numbers even in eval mode ({', '.join(sorted(seen))}: "
                               "noise or timesteps sampled in the training step?), so the same samples give "
                               "another loss each time")
    except torch.cuda.OutOfMemoryError:
        return "unknown", "the check's forward ran out of memory"
    finally:
        if device_type == "cuda":
            # the check's blocks go back to the device: cached, their sizes could stand in the way of the step's
            torch.cuda.empty_cache()
    scale = max(abs(once), abs(doubled))
    if not (math.isfinite(once) and math.isfinite(doubled)) or scale < 1e-12:
        return "unknown", f"the loss of the check's samples is {once:g}"
    is_mean = abs(doubled - once) <= _TOLERANCE * scale
    is_sum = abs(doubled - 2 * once) <= _TOLERANCE * scale
    if is_mean != is_sum:
        if is_mean and mismatch is not None:
            return "masked", mismatch
        return ("mean" if is_mean else "sum"), ""
    if is_mean:  # both: the loss is about 0 on these samples
        return "unknown", f"the loss of the check's samples is {once:g}"
    k = batch_size(head)
    return "coupled", f"the loss of {k} sample(s) given twice is {doubled:.4g} against {once:.4g} given once"


def _loss_of_copy(model: nn.Module, batch: Any, loss_fn: Any) -> torch.Tensor:
    """The loss of a copy of ``batch``: a forward that writes into its inputs (``x.sub_(mean)``) would otherwise change
    the batch the step then trains on, and the check's next forward."""
    return _batch.compute_loss(model, tree_map(lambda t: t.clone(), batch), loss_fn).detach()


def _weighting_mismatch(model: nn.Module, whole: Any, halves: list[Any], known: dict[int, float], loss_fn: Any,
                        precision: str, causal: bool) -> str | None:
    """A mean loss is split exactly only if the whole's loss is its parts' losses weighted by their loss items
    (samples, or labels != -100): what the accumulation does. A mean over items the batch's values choose (a mask,
    padding left out under another ``ignore_index``) is weighted otherwise, silently. The whole and the halves not in
    ``known`` (losses already measured, by index) run here; None when the weights hold (``why`` otherwise). fp32
    agrees to rounding; bf16 autocast may pick other kernels at another batch size.

    Where the halves' losses are too close for the whole's loss to tell the accumulation's weights from those of a
    mask in the batch that leaves labelled items out (``attention_mask`` zeros where the labels carry loss: a loss
    averaged over the mask's ones), the check cannot vouch for the weights, and says so: at initialisation every
    sample's loss is about the same, while the gradients of the two weightings differ."""
    counts = [_batch.count_loss_items(h, causal=causal) for h in halves]
    if max(counts) <= 0:
        return None
    first, second = (known[i] if i in known else float(_loss_of_copy(model, halves[i], loss_fn)) for i in (0, 1))
    whole_loss = float(_loss_of_copy(model, whole, loss_fn))
    # a part without items is skipped by the accumulation (its weight is 0): exact only if the whole's loss leaves
    # its samples out too (a mean over labelled items), not if a term over every sample sees them
    counted = [(n, loss) for n, loss in zip(counts, (first, second)) if n > 0]
    weighted = sum(n * loss for n, loss in counted) / sum(n for n, _ in counted)
    if not math.isfinite(whole_loss):
        return None
    if not math.isfinite(weighted):  # a half with nothing to average over (every item masked): 0/0
        return (f"the loss of {batch_size(whole)} samples is {whole_loss:.6g}, but the loss of a part of them "
                f"is {first if not math.isfinite(first) else second:g}")
    tol = (_TOLERANCE / 5 if precision != "fp32" else 1e-4) * max(abs(whole_loss), abs(weighted), 1e-12)
    unit = "samples" if _batch.token_labels(whole, causal) is None else "labels other than -100"
    if abs(whole_loss - weighted) <= tol:
        for path, masked in _label_masks(halves, causal):
            if masked[0] * counts[1] == masked[1] * counts[0]:
                continue  # the mask weighs the halves as the labels do: either way the same gradient
            by_mask = (masked[0] * first + masked[1] * second) / max(sum(masked), 1)
            if abs(whole_loss - by_mask) <= tol:
                return (f"the loss of {batch_size(whole)} samples ({whole_loss:.6g}) matches its halves weighted by "
                        f"their {unit} ({counts[0]}, {counts[1]}) and weighted by the ones of {path} "
                        f"({masked[0]}, {masked[1]}) alike, and {path} leaves out positions whose labels carry loss: "
                        "memopt cannot tell which the loss averages over, and the two weigh micro-batches "
                        "differently")
        return None
    if len(counted) < 2:
        return (f"the loss of {batch_size(whole)} samples is {whole_loss:.6g}, but {weighted:.6g} without those with "
                f"no {unit}, which a split leaves out (a term over every sample beside a mean over labelled ones?)")
    return (f"the loss of {batch_size(whole)} samples is {whole_loss:.6g}, but its two halves' losses "
            f"({first:.6g}, {second:.6g}) weighted by their {unit} ({counts[0]}, {counts[1]}) give {weighted:.6g}")


def _label_masks(halves: list[Any], causal: bool) -> list[tuple[str, list[int]]]:
    """(path, the labelled positions it keeps in each half) for each 0/1 tensor of the labels' shape that is 0 at
    some position whose label carries loss: a mask the loss may average over instead of the labels."""
    kept: dict[str, list[int]] = {}
    drops: set[str] = set()
    other: set[str] = set()  # not a 0/1 tensor in some half
    for h, half in enumerate(halves):
        labels, full = _batch.token_labels(half, causal), _batch.labels_of(half)
        if labels is None or labels.dim() < 2:
            return []
        carries = labels != _batch.IGNORE_INDEX
        for path, t in leaves(half):
            if t is full or t.shape != full.shape or t.is_floating_point() or t.is_complex():
                continue
            mask = t[..., 1:] if causal else t
            if bool(((mask != 0) & (mask != 1)).any()):
                other.add(path)
                continue
            kept.setdefault(path, [0] * len(halves))[h] = int(((mask != 0) & carries).sum())
            if bool(((mask == 0) & carries).any()):
                drops.add(path)
    return [(path, n) for path, n in kept.items() if path in drops and path not in other]


def measure_reduction(model: nn.Module, micro_batch: Any, loss_fn: Any, *, precision: str, device_type: str,
                      causal: bool = False) -> str:
    """"mean" or "sum" (:func:`classify_reduction`). Raises :class:`LossNotSplittable` when it is neither, or a
    mean weighted otherwise than by loss items; returns "mean" with a warning when the check cannot tell."""
    verdict, why = classify_reduction(model, micro_batch, loss_fn, precision=precision, device_type=device_type,
                                      causal=causal)
    return settle(verdict, why)


def settle(verdict: str, why: str) -> str:
    """The mode a verdict trains under: "mean" or "sum"; a coupled loss raises, an unknown one warns."""
    if verdict == "coupled":
        raise LossNotSplittable(
            f"{why}: it is neither a mean (the same) nor a sum (twice) over the samples (in-batch negatives, or a "
            "statistic of the whole batch?), so micro-batches cannot reproduce the whole batch's gradient; give a "
            "budget that fits the whole batch, or pass loss_reduction='mean' to accumulate micro-batches weighted by "
            "their samples anyway")
    if verdict == "masked":
        raise LossNotSplittable(
            f"{why}: the loss is a mean over items the batch's values select (a mask, or an ignore_index other than "
            "-100?), so micro-batches weighted by their share of the batch would not reproduce its gradient; give a "
            "budget that fits the whole batch, mark the items left out with label -100, or pass "
            "loss_reduction='mean' to split it anyway")
    if verdict == "terms":
        raise LossNotSplittable(
            f"{why}, so no weighting of micro-batches reproduces the whole batch's gradient; give a budget that fits "
            "the whole batch, or pass loss_reduction='mean' to split it anyway")
    if verdict == "per_sample":
        raise LossNotSplittable(
            f"{why}, so micro-batches weighted by their labels other than -100 would not reproduce the whole batch's "
            "gradient; give a budget that fits the whole batch, or set ctc_loss_reduction='sum' in the model's config "
            "(a sum splits exactly)")
    if verdict == "unknown":
        return _unknown(why)
    return verdict


def _unknown(why: str) -> str:
    warnings.warn(f"memopt could not tell whether the loss is a mean or a sum over the samples ({why}); it is "
                  "accumulated as a mean: pass loss_reduction='sum' to memopt.wrap if it is a sum", stacklevel=3)
    return "mean"
