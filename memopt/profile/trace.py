"""Traces that the profile records: one forward + backward of a block-truncated copy of the model.

A *variant* is what changes the bytes a forward and backward allocate: precision group, activation
checkpointing mode, attention backend, chunked cross-entropy, activation offload, and the extras that
transform the model (quantized frozen base weights, adapters). Each variant is
traced at micro-batch 1 and 2 on a copy whose block stacks keep ``TRACED_BLOCKS`` blocks (first,
second, a middle one that stands for all the others, last); the events of the two traces are aligned
one to one, so the bytes of every allocation at any micro-batch ``b`` follow exactly
(``bytes(b) = bytes(1) + (b - 1) * (bytes(2) - bytes(1))``, before the allocator rounds them).

A variant with extras also records the model state of the transformed, truncated model (every parameter
and buffer: shape, dtype, trainable, and the block it belongs to): the full model's state follows by
repeating the middle block (:func:`memopt.profile.model_state.expand_model_state`), and so does the optimizer's
parameter set.

The optimizer step is traced on its own, over fake parameters and gradients of the *full* model
(:mod:`memopt.profile.optimizer_trace`); :mod:`memopt.profile.trace_alignment` pairs the two traces' events.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from memopt.blocks import find_block_stacks
from memopt.categories import MemoryCategory
from memopt.profile.attention_select import UnsupportedAttention as UnsupportedAttentionError
from memopt.profile.attribution import ModuleAttribution, attribution_with_ops, merge_record, trace_record
from memopt.profile.costs import CostRecorder, PhaseCost
from memopt.profile.cuda_semantics import KernelPolicy, trace_semantics
from memopt.profile.fake_model import TruncatedStackIndexed, fake_copy, grads_kept, train_as_given
from memopt.profile.hf_compat import real_code_paths
from memopt.profile.loss_key import modules_in
from memopt.profile.markers import install_markers
from memopt.profile.model_state import model_state_entries
from memopt.profile.process_caches import caches_kept_real
from memopt.profile.scalar_values import ShadowFormatting
from memopt.profile.simulate import trace_device
from memopt.profile.stand_ins import TRACE_STAND_INS
from memopt.profile.trace_alignment import alignment_opcodes
from memopt.profile.tracing_flag import tracing
from memopt.profile.tracker import ALLOC, MemoryTracker, dense_only
from memopt.profile.variant_trace import Segment, VariantKey, VariantTrace
from memopt.step.batch_tree import tensors as batch_tensors
from memopt.step.prepare import prepare
from memopt.step.train_step import TrainStep
from memopt.strategy import Strategy
from memopt.techniques.micro_batching import batch_statistics_guard

__all__ = ["TRACED_BLOCKS", "BatchFactory", "TraceAlignmentError", "trace_variant"]

TRACED_BLOCKS = 4


class TraceAlignmentError(RuntimeError):
    """The traces at micro-batch 1 and 2 did not run the same ops (shapes steer the model's code)."""


@dataclass
class _RawTrace:
    phases: list[str]
    events: list[tuple[int, int, int, int, str]]  # (kind, key, bytes, phase, op that allocated the key)
    costs: dict[int, PhaseCost]
    grad_keys: set[int]
    persistent_keys: set[int]
    inputs: list[int]
    attention: list[str]
    traced_blocks: list[int]
    offload: dict[int, int]  # phase -> bytes copied to the host
    micro_batch: int = 1
    model_state: dict[str, Any] | None = None
    attribution: dict[str, Any] | None = None
    bounded_ops: list[str] = field(default_factory=list)
    value_reads: int = 0  # floating values read without being known (memopt.profile.tracker.FLOAT_READ_STAND_IN)


BatchFactory = Callable[[int, str], Any]  # (micro_batch_size, device) -> batch (memopt.step.batch)


def _one_pass(model: nn.Module, batch_factory: BatchFactory, micro_batch: int, strategy: Strategy,
              policy: KernelPolicy, keep_blocks: int, loss_fn: Any, whole: set[str] | None = None) -> _RawTrace:
    """One traced step at ``micro_batch``. A stack that the model reads by position past the kept blocks is
    traced whole (added to ``whole``, which the other passes of the variant share)."""
    whole = set() if whole is None else whole
    while True:
        try:
            with grads_kept(model, *modules_in(loss_fn)):
                return _pass(model, batch_factory, micro_batch, strategy, policy, keep_blocks, loss_fn, whole)
        except TruncatedStackIndexed as exc:
            if exc.path in whole:
                raise
            whole.add(exc.path)


def _pass(model: nn.Module, batch_factory: BatchFactory, micro_batch: int, strategy: Strategy,
          policy: KernelPolicy, keep_blocks: int, loss_fn: Any, whole: set[str]) -> _RawTrace:
    device, emulate = trace_device(policy)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    clone = fake_copy(model, fake_mode, device, keep_blocks=keep_blocks, keep_whole=whole)
    train_as_given(clone, model)
    tracker = MemoryTracker(device)
    costs = CostRecorder(lambda: tracker._phase)
    attention: list[str] = []
    semantics = trace_semantics(policy, tracker, attention, emulate=emulate)
    host = "meta" if emulate else "cpu"
    with caches_kept_real(model), fake_mode, semantics, real_code_paths():
        prepared = prepare(clone, strategy, device_type=device, stand_ins=TRACE_STAND_INS, host_device=host,
                           loss_fn=loss_fn)
        # from here on the techniques are applied to the copy: undone whatever fails, so that nothing of them (a
        # checkpoint wrapper, a cast) outlives the trace
        remove: Any = None
        attrib: ModuleAttribution | None = None
        try:
            has_extras = strategy.extra("quantization") is not None or strategy.extra("adapters") is not None
            model_state = model_state_entries(clone, prepared.stacks) if has_extras else None
            remove = install_markers(prepared.stacks, tracker.set_phase)
            attrib = ModuleAttribution(clone, lambda: tracker.run.phases[tracker._phase])
            tracker.module_fn = attrib.current
            tracker.op_hooks.append(costs)
            offload_by_phase: dict[int, int] = {}
            if prepared.step.offload is not None:
                off = prepared.step.offload
                pack = off.pack

                def counting_pack(t: torch.Tensor) -> Any:
                    before = off.bytes_offloaded
                    packed = pack(t)
                    ph = tracker._phase
                    offload_by_phase[ph] = offload_by_phase.get(ph, 0) + off.bytes_offloaded - before
                    return packed

                off.pack = counting_pack
            with tracker, ShadowFormatting(tracker.shadows), batch_statistics_guard(clone):
                for p in clone.parameters():
                    tracker.track(p, MemoryCategory.PARAMETERS, "parameter")
                for b in clone.buffers():
                    tracker.track(b, MemoryCategory.PARAMETERS, "buffer")
                batch = batch_factory(micro_batch, device)
                _shadow_batch_values(tracker, batch_factory, micro_batch, batch)
                for i, v in enumerate(batch_tensors(batch)):
                    dense_only(v, f"tensor {i} of the batch")
                inputs = [v.untyped_storage().nbytes() for v in batch_tensors(batch)]
                for v in batch_tensors(batch):
                    tracker.track(v, MemoryCategory.ACTIVATIONS, "input")
                step: TrainStep = prepared.step
                tracker.set_phase("forward[0]")
                loss = step.loss(batch)
                tracker.set_phase("backward[0]")
                step.backward(loss)
                del loss
                tracker.set_phase("end")
                grads = {tracker.key_of(p.grad) for p in clone.parameters() if p.grad is not None} - {None}
            record = trace_record(clone, [s.path for s in prepared.stacks], tracker, attrib, {})
        finally:
            if attrib is not None:
                attrib.remove()
            if remove is not None:
                remove()
            prepared.undo()
    setup_end = tracker.run.phases.index("forward[0]")
    labels = tracker.run.labels
    alloc_label: dict[int, str] = {}
    op_of: dict[int, str] = {}
    events = []
    for k, key, size, ph, lab in tracker.run.events:
        if k == ALLOC:
            alloc_label[key] = labels[lab]
        if ph >= setup_end:
            events.append((k, key, size, ph, alloc_label.get(key, "")))
            if k == ALLOC:
                op_of[key] = labels[lab]
    return _RawTrace(phases=tracker.run.phases, events=events, costs=dict(costs.costs), grad_keys=grads,
                     persistent_keys=set(tracker.run.persistent_keys), inputs=inputs, attention=attention,
                     traced_blocks=[len(s) for s in find_block_stacks(clone)], offload=offload_by_phase,
                     micro_batch=micro_batch, model_state=model_state,
                     attribution=attribution_with_ops(record, tracker, op_of),
                     bounded_ops=sorted(tracker.run.bounded_ops), value_reads=tracker.run.value_reads)


def _shadow_batch_values(tracker: MemoryTracker, batch_factory: BatchFactory, micro_batch: int, batch: Any) -> None:
    """The integer and boolean tensors of a batch whose factory makes real values (``values_are_real``: the token
    ids, masks and labels of ``memopt.models.make_batch``) get those values as shadows, so that what the model reads
    from them is what the real batch holds."""
    if not getattr(batch_factory, "values_are_real", False):
        return
    with unset_fake_temporarily(), torch.random.fork_rng(devices=[]):
        real = batch_factory(micro_batch, "cpu")
    fakes, reals = batch_tensors(batch), batch_tensors(real)
    if len(fakes) == len(reals):
        for fake, value in zip(fakes, reals):
            tracker.shadows.adopt(fake, value)


def _segments(raw: _RawTrace) -> list[tuple[str, int, list[tuple[int, int, int, str]]]]:
    by_phase: dict[int, list[tuple[int, int, int, str]]] = {}
    for kind, key, size, ph, label in raw.events:
        by_phase.setdefault(ph, []).append((kind, key, size, label))
    first = raw.phases.index("forward[0]")
    out = []
    for i in range(first, len(raw.phases)):
        if raw.phases[i] == "end":
            break
        out.append((raw.phases[i], i, by_phase.get(i, [])))
    return out


def _align(one: _RawTrace, two: _RawTrace) -> tuple[list[Segment], str]:
    """Pair the events of two traces (smaller size first); keys of the result are those of the first.

    Events are matched by (kind, allocating op) with a sequence alignment. Events only the larger size has
    (a copy that a dimension of size 1 let the smaller skip) are kept, with bytes proportional to the
    micro-batch; events only the smaller size has are dropped. Returns the segments and how they matched:
    "exact" (every event), "inserts" (the larger size only added events: the result holds for micro-batches >=
    the larger size) or "mismatch" (the two ran other ops, or paired tensors of other shapes: it does not hold).
    """
    s1, s2 = _segments(one), _segments(two)
    if [n for n, _, _ in s1] != [n for n, _, _ in s2]:
        raise TraceAlignmentError("the two traces passed different phases")
    mapping: dict[int, int] = {}
    status = "exact"
    segments: list[Segment] = []
    for (name, ph1, ev1), (_, ph2, ev2) in zip(s1, s2):
        a = [(e[0], e[3]) for e in ev1]
        c = [(e[0], e[3]) for e in ev2]
        merged: list[tuple[int, int, int, int]] = []
        for op, i1, i2, j1, j2 in alignment_opcodes(a, c):
            if op == "equal":
                for (k1, key1, b1, _), (_, key2, b2, _) in zip(ev1[i1:i2], ev2[j1:j2]):
                    if k1 == ALLOC:
                        mapping[key2] = key1
                        merged.append((k1, key1, b1, b2))
                    else:
                        merged.append((k1, mapping.get(key2, key1), b1, b2))
                continue
            status = "inserts" if op == "insert" and status != "mismatch" else "mismatch"
            for k2, key2, b2, _ in ev2[j1:j2]:  # only at the larger size: proportional to the micro-batch
                unmatched = key2 + _UNMATCHED
                key = mapping.setdefault(key2, unmatched) if k2 == ALLOC else mapping.get(key2, unmatched)
                merged.append((k2, key, b2 * one_size(one) // one_size(two), b2))
        segments.append(Segment(name=name, events=merged, cost1=one.costs.get(ph1, PhaseCost()),
                                cost2=two.costs.get(ph2, PhaseCost()),
                                offload=(one.offload.get(ph1, 0), two.offload.get(ph2, 0))))
    # an allocation that shrinks as the micro-batch grows is two different tensors paired by the alignment (same
    # op, other shapes: a weight-sized buffer against an activation): extrapolated, it would go negative
    if any(k == ALLOC and hi < lo for seg in segments for k, _, lo, hi in seg.events):
        status = "mismatch"
    return segments, status


_NEVER = 1 << 30  # min_b of a linear trace that holds for no size (each size is traced exactly)
_UNMATCHED = 1 << 40  # keys of events only the larger trace has (kept apart from the smaller trace's keys)


def one_size(raw: _RawTrace) -> int:
    return raw.micro_batch


def _exact_segments(raw: _RawTrace) -> list[Segment]:
    return [Segment(name=name, events=[(k, key, size, size) for k, key, size, _ in ev],
                    cost1=raw.costs.get(ph, PhaseCost()), cost2=raw.costs.get(ph, PhaseCost()),
                    offload=(raw.offload.get(ph, 0), raw.offload.get(ph, 0)))
            for name, ph, ev in _segments(raw)]


def trace_variant(model: nn.Module, batch_factory: BatchFactory, key: VariantKey, policy: KernelPolicy, *,
                  keep_blocks: int = TRACED_BLOCKS, loss_fn: Any = None) -> list[VariantTrace]:
    """Trace one variant (:func:`_trace_variant`), the fake mode's log of failing ops silenced
    (:func:`meta_failures_unlogged`)."""
    with meta_failures_unlogged(), tracing():
        return _trace_variant(model, batch_factory, key, policy, keep_blocks=keep_blocks, loss_fn=loss_fn)


@contextlib.contextmanager
def meta_failures_unlogged() -> Iterator[None]:
    """The fake mode logs the traceback of every op whose meta kernel fails, before it raises (thousands of lines for
    a model step that fails under one variant); memopt reports such a failure itself, in one line."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fake_log.setLevel(level)


def _trace_variant(model: nn.Module, batch_factory: BatchFactory, key: VariantKey, policy: KernelPolicy, *,
                   keep_blocks: int, loss_fn: Any) -> list[VariantTrace]:
    """Trace one variant. ``key.micro_batch`` set: that size only. Otherwise micro-batches 1 and 2, aligned
    into one linear trace; when a size-1 batch dimension changed the ops (a reshape skipped a copy), the
    linear trace holds from micro-batch 2 on and an exact micro-batch-1 trace is returned as well."""
    strategy = key.strategy()
    whole: set[str] = set()  # stacks the model reads by position past the kept blocks: traced whole

    def build(segments: list[Segment], raw1: _RawTrace, raw2: _RawTrace, k: VariantKey, lo: int, hi: int,
              min_b: int) -> VariantTrace:
        return VariantTrace(key=k, segments=segments, grad_keys=set(raw1.grad_keys),
                            persistent_keys=set(raw1.persistent_keys),
                            input_bytes=(sum(raw1.inputs), sum(raw2.inputs)),
                            input_sizes=list(zip(raw1.inputs, raw2.inputs)),
                            attention_backends=sorted(set(raw1.attention)), traced_blocks=raw1.traced_blocks,
                            lo=lo, hi=hi, min_b=min_b, model_state=raw1.model_state,
                            attribution=merge_record(raw1.attribution, raw2.attribution if raw2 is not raw1 else None,
                                                     {e[1] for seg in segments for e in seg.events}, _UNMATCHED),
                            bounded_ops=sorted(set(raw1.bounded_ops) | set(raw2.bounded_ops)),
                            value_reads=max(raw1.value_reads, raw2.value_reads))

    if key.micro_batch is not None:
        raw = _one_pass(model, batch_factory, key.micro_batch, strategy, policy, keep_blocks, loss_fn, whole)
        return [build(_exact_segments(raw), raw, raw, key, key.micro_batch, key.micro_batch, key.micro_batch)]
    try:
        one = _one_pass(model, batch_factory, 1, strategy, policy, keep_blocks, loss_fn, whole)
    except (UnsupportedAttentionError, TraceAlignmentError):
        raise
    except Exception:
        two = _one_pass(model, batch_factory, 2, strategy, policy, keep_blocks, loss_fn, whole)
        three = _one_pass(model, batch_factory, 3, strategy, policy, keep_blocks, loss_fn, whole)
        segments, status = _align(two, three)
        return [build(segments, two, three, key, 2, 3, {"exact": 2, "inserts": 3}.get(status, _NEVER))]
    two = _one_pass(model, batch_factory, 2, strategy, policy, keep_blocks, loss_fn, whole)
    segments, status = _align(one, two)
    if status == "exact":
        return [build(segments, one, two, key, 1, 2, 1)]
    exact_one = build(_exact_segments(one), one, one, key.at(1), 1, 1, 1)
    if status == "inserts":  # a size-1 dimension let a kernel skip a copy: linear from micro-batch 2 on
        return [build(segments, one, two, key, 1, 2, 2), exact_one]
    # micro-batch 1 took other code paths (a recurrent kernel, a fast path for one sample): the linear trace
    # comes from micro-batches 2 and 3, and micro-batch 1 is traced exactly
    three = _one_pass(model, batch_factory, 3, strategy, policy, keep_blocks, loss_fn, whole)
    segments, status = _align(two, three)
    if status != "mismatch":
        return [build(segments, two, three, key, 2, 3, 2 if status == "exact" else 3), exact_one,
                build(_exact_segments(two), two, two, key.at(2), 2, 2, 2)]
    # no two sizes run the same ops: every micro-batch size is traced exactly when a plan asks for it
    return [build(segments, two, three, key, 2, 3, _NEVER), exact_one,
            build(_exact_segments(two), two, two, key.at(2), 2, 2, 2)]
