"""``memopt.plan(model, sample=..., budget="40GB")``: the fastest strategy that fits, and why."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from memopt.estimate.allocator import EventStreamError
from memopt.estimate.estimator import Estimate, TotalAbove, estimate_strategy
from memopt.estimate.store import EstimateStore
from memopt.hardware import HardwareSpec, default_hardware_note, load_hardware
from memopt.plan.floors import FLOOR_REASON, state_floor
from memopt.plan.policy import ALLOWANCES, Policy
from memopt.plan.schema import Plan
from memopt.plan.search import Evaluated, SearchResult, candidates, evaluate, extras_saving, search, unestimated_notes
from memopt.plan.sharded import plan_sharded, world_of
from memopt.profile.api import profile_model
from memopt.profile.profile import Profile
from memopt.strategy import Checkpointing, Strategy
from memopt.techniques.adapters import peft_installed
from memopt.techniques.attention import flash_attn_available
from memopt.techniques.optimizers import bnb_installed
from memopt.techniques.registry import SearchContext
from memopt.units import format_bytes, parse_bytes

__all__ = ["CALIBRATION_MODES", "make_plan", "resolve_hardware", "resolve_policy"]


def resolve_hardware(hardware: str | HardwareSpec | dict | None) -> HardwareSpec:
    """The spec to plan for: a shipped name, a dict, a spec; ``"auto"`` the local GPU (an error without one); None
    the local GPU or, when none is visible, ``memopt.hardware.DEFAULT_HARDWARE`` (the plan's notes say so)."""
    return load_hardware(hardware)


def resolve_policy(policy: Policy | dict[str, Any] | None, **overrides: Any) -> Policy:
    if isinstance(policy, Policy) and not any(v is not None for v in overrides.values()):
        return policy
    data: dict[str, Any] = {}
    if isinstance(policy, Policy):
        data = {"fidelity": sorted(policy.allow), "pins": policy.pins, "forbid": policy.forbid,
                "max_micro_batch": policy.max_micro_batch}
    elif isinstance(policy, dict):
        data = dict(policy)
    elif policy is not None:
        raise ValueError(f"policy must be a memopt Policy or a dict, got {type(policy).__name__}")
    data.update({k: v for k, v in overrides.items() if v is not None})
    return Policy.build(**data)


def _context(profile: Profile, hw: HardwareSpec, global_batch: int, policy: Policy,
             user_optimizer: bool) -> SearchContext:
    vocab = profile.vocab_size
    if vocab is None:  # a profile saved before the vocabulary was recorded: ask its model, if one is at hand
        vocab = getattr(getattr(profile._model, "config", None), "vocab_size", None)
    # PyTorch's own choice ("auto") is searched; a named backend only when pinned: on the GPUs modelled the
    # other kernels allocate at least as much and run no faster than the one SDPA picks
    backends = ("auto",) if "attention" not in policy.pins else (policy.pins["attention"],)
    return SearchContext(global_batch=global_batch, block_counts=tuple(profile.full_block_counts),
                         supports_bf16=hw.supports_bf16, vocab_size=vocab,
                         causal_lm=profile.family == "causal_lm" and not profile.chunked_ce_refusal,
                         bnb_available=bnb_installed(), flash_attn_available=flash_attn_available(),
                         peft_available=peft_installed(),
                         user_optimizer=user_optimizer, attention_backends=backends,
                         max_micro_batch=policy.max_micro_batch)


def make_plan(model: Any, sample: Any = None, *, budget: str | int | float, hardware: Any = None,
              policy: Policy | dict[str, Any] | None = None, fidelity: Any = None, pins: dict[str, Any] | None = None,
              forbid: dict[str, Any] | None = None, optimizer: Any = None, loss_fn: Any = None,
              training_step: Any = None, profile: Profile | None = None, use_cache: bool = True,
              use_calibration: bool = True, calibration: str = "use", world_size: int | None = None,
              nodes: int | None = None, host_memory: str | int | None = None, nvme_path: str | None = None) -> Plan:
    """Plan the fastest strategy for training ``model`` on ``sample`` that fits ``budget`` per GPU.

    ``model`` and ``sample`` are what ``memopt.profile`` takes (a module, a shipped model name, ...). The
    sample's batch size is the global batch; micro-batching keeps it. ``budget`` follows DEVELOPERS.md
    ("40GB", "40GiB", "80%", bytes). ``policy`` (or ``fidelity``/``pins``/``forbid``) says what may change.
    ``optimizer`` is a callable taking the parameters when the user brings their own optimizer. ``loss_fn`` /
    ``training_step``: how the loss is made (``memopt.apply.batch``), as in ``memopt.wrap``.
    ``calibration``: "use" (default): where earlier clean runs of this model on this GPU kind measured more than was
    predicted (``memopt.guard.calibration``, written by ``memopt.wrap``'s guard), widen the margin by that ratio
    and say so in the plan's notes; "ignore": plan without it; "clear": delete this model's stored calibration on
    this GPU kind first (``use_calibration=False`` is "ignore"). ``hardware``: a shipped name, a dict or a
    ``HardwareSpec``; "auto" the local GPU; not given: the local GPU, else ``memopt.hardware.DEFAULT_HARDWARE``
    (the notes say so). Every argument is checked first; bad input raises one ``ValueError`` listing each
    problem on its own line (``memopt.config.checks``).

    Beyond one GPU (``memopt.plan.sharded``): ``world_size`` GPUs over ``nodes`` nodes (default: the hardware
    spec's ``gpus_per_node x num_nodes``) are planned with DDP, ZeRO-1/2/3, FSDP2 (hybrid across nodes) and CPU /
    NVMe offload, the engine chosen by predicted speed; on one GPU, offload is planned when nothing else fits.
    ``host_memory``: RAM per node (default: the spec's ``host_memory_bytes``, else this machine's); ``nvme_path``: a
    directory on a local NVMe drive for ZeRO-Infinity (default: the spec's ``extra["nvme_path"]``; none: no NVMe).
    """
    start = time.perf_counter()
    if training_step is not None:  # (model, batch) -> loss: the batch contract of memopt.apply.batch
        from memopt.apply.batch import as_loss

        loss_fn = as_loss(loss_fn, training_step)
    if loss_fn is not None and profile is None:  # chunked cross-entropy replaces the model's own loss, not the user's
        pins = {"chunked_ce": 0, **(pins or {})}
    hw, budget_bytes, pol = _checked_args(model, sample, budget=budget, hardware=hardware, policy=policy,
                                          fidelity=fidelity, pins=pins, forbid=forbid, optimizer=optimizer,
                                          calibration=calibration, world_size=world_size, nodes=nodes,
                                          host_memory=host_memory, nvme_path=nvme_path)
    if not use_calibration:
        calibration = "ignore"
    notes: list[str] = []
    hw_note = default_hardware_note(hardware, hw)
    if hw_note:
        notes.append(hw_note)
    if budget_bytes <= hw.runtime_overhead_bytes:
        raise ValueError(
            f"budget {format_bytes(budget_bytes)} is below what the CUDA runtime alone holds on {hw.name} "
            f"({format_bytes(hw.runtime_overhead_bytes)} outside PyTorch's allocator); give at least "
            f"{format_bytes(hw.runtime_overhead_bytes + pol.margin(budget_bytes) + (1 << 30))}")
    if budget_bytes > hw.memory_bytes:
        notes.append(f"the budget {format_bytes(budget_bytes)} is more than {hw.name} has "
                     f"({format_bytes(hw.memory_bytes)}); planning for the budget as given")
    prof = profile if profile is not None else profile_model(model, sample, hardware=hw, loss_fn=loss_fn,
                                                             optimizer=optimizer, use_cache=use_cache)
    if prof.sample.get("variable_length"):
        notes.append(f"batches vary in length: planned for the longest (seq_len={prof.sample.get('seq_len')})")
    notes.extend(prof.notes)
    pol = _calibrated(pol, prof, hw, budget_bytes, notes, calibration)
    global_batch = int(prof.sample["batch_size"])
    _check_batch(pol, global_batch, world_size or world_of(hw)[0])
    ctx = _context(prof, hw, global_batch, pol, optimizer is not None and not isinstance(optimizer, str))
    store = EstimateStore(prof) if use_cache else None
    estimates = _Estimates(prof, hw, store=store)

    def level_check(level: tuple) -> tuple[bool, int | None]:
        return _level_fits(prof, hw, pol, ctx, budget_bytes, level, estimates)

    world, n_nodes = world_of(hw)
    world, n_nodes = world_size or world, nodes or (n_nodes if world_size is None else 1)
    host = parse_bytes(host_memory) if host_memory is not None else None
    nvme = nvme_path or hw.extra.get("nvme_path")
    with prof.batched_saves():  # the traces this plan adds are written to the cache once, at the end
        if world > 1:  # every candidate is a sharded one (DDP included)
            plan = _sharded(prof, hw, budget_bytes, pol, notes, world, n_nodes, host, nvme, start)
        else:
            result = search(prof, hw, budget_bytes, pol, ctx, level_check=level_check)
            offload = None
            if result.best is None and pol.allows("offload", True) and pol.allows("precision", "bf16_autocast") \
                    and hw.supports_bf16:
                try:
                    offload = _sharded(prof, hw, budget_bytes, pol, list(notes), 1, 1, host, nvme, start)
                except ValueError as exc:  # the model cannot run as the engine runs it: the single-GPU report stands
                    notes.append(f"offloading the model states to the host was not possible: {exc}")
            # where an offload plan answers, the single-GPU report is only a note: its relaxations are given by
            # their trace-free floors
            plan = _build_plan(prof, hw, budget_bytes, pol, result, notes, time.perf_counter() - start, store,
                               floors_only=offload is not None and offload.fits)
            if offload is not None:
                plan = _with_offload(plan, offload)
            from memopt.estimate.attribution import attach_to_plan

            attach_to_plan(plan, prof, hw)  # where every byte of the chosen plan goes (report, output=json)
    if store is not None:
        store.save()
    from memopt.config.checks import check_pins_honoured, profile_fingerprint

    plan.model["fingerprint"] = profile_fingerprint(prof)
    check_pins_honoured(plan, pol.pins)
    return plan


def _checked_args(model: Any, sample: Any, *, budget: Any, hardware: Any, policy: Any, fidelity: Any, pins: Any,
                  forbid: Any, optimizer: Any, calibration: Any, world_size: Any, nodes: Any, host_memory: Any,
                  nvme_path: Any) -> tuple[HardwareSpec, int, Policy]:
    """Every argument of ``make_plan`` checked before anything is traced: (hardware, budget bytes, policy), or
    one ``InputError`` (a ValueError) listing every problem."""
    from memopt.config import checks

    problems: list[str] = []
    hw = checks.check_hardware(hardware, problems)
    budget_bytes = checks.check_budget(budget, problems, device_total_bytes=hw.memory_bytes if hw else None)
    pol = None
    for name, value in (("pins", pins), ("forbid", forbid)):
        if value is not None and not isinstance(value, dict):
            problems.append(f"{name} must be a dict such as {{'micro_batch_size': 2}}, got {type(value).__name__}")
    if not any(p.startswith(("pins must", "forbid must")) for p in problems):
        try:
            pol = resolve_policy(policy, fidelity=fidelity, pins=pins, forbid=forbid)
        except (ValueError, TypeError) as exc:
            lines = [ln.strip()[2:] for ln in str(exc).splitlines() if ln.strip().startswith("- ")]
            problems.extend(f"policy: {ln}" for ln in (lines or [str(exc)]))
    checks.check_margin(pol, budget_bytes, problems)
    checks.check_world(world_size, nodes, problems)
    checks.check_nvme_path(nvme_path, problems)
    if host_memory is not None:
        try:
            if parse_bytes(host_memory, what="host_memory") == 0:
                problems.append("host_memory=0: give the RAM per node, e.g. host_memory='512GiB'")
        except (ValueError, OverflowError) as exc:
            problems.append(str(exc))
    if isinstance(optimizer, str) or (optimizer is not None and not callable(optimizer)):
        checks.check_optimizer(optimizer, problems)
    if calibration not in CALIBRATION_MODES:
        problems.append(f"calibration={calibration!r} is not one of {', '.join(CALIBRATION_MODES)}"
                        f"{checks.closest(calibration, CALIBRATION_MODES)}")
    spec = _spec_of(model)
    if spec is not None:
        checks.check_model_keys(spec, problems)
    if isinstance(sample, dict) and pol is not None:
        checks.check_global_batch_pins(pol.pins, sample.get("batch_size"), problems, key="pins.micro_batch_size",
                                       batch_key="sample batch_size")
    checks.raise_problems(problems, "arguments")
    assert hw is not None and budget_bytes is not None and pol is not None
    return hw, budget_bytes, pol


def _spec_of(model: Any) -> Any:
    """The model spec behind a shipped name / YAML path / dict / ModelSpec, else None (a module, a callable)."""
    if isinstance(model, (str, dict)) or type(model).__name__ == "ModelSpec":
        if isinstance(model, dict) and "_target_" in model:
            return None
        from memopt.models import load_model_spec

        try:
            return load_model_spec(model)
        except (ValueError, TypeError, OSError):
            return None  # profile_model reports it
    return None


def _check_batch(pol: Policy, global_batch: int, world: Any) -> None:
    """A pinned micro-batch against the profile's global batch (per rank on several GPUs)."""
    from memopt.config import checks

    problems: list[str] = []
    per_rank = global_batch // world if isinstance(world, int) and world > 1 and global_batch % world == 0 \
        else global_batch
    checks.check_global_batch_pins(pol.pins, per_rank, problems,
                                   batch_key="the batch per GPU" if per_rank != global_batch else "batch_size")
    checks.raise_problems(problems, "pins")


def _sharded(prof: Profile, hw: HardwareSpec, budget: int, pol: Policy, notes: list[str], world: int, nodes: int,
             host: int | None, nvme: str | None, start: float) -> Plan:
    plan, _ = plan_sharded(prof, hw, budget, pol, world_size=world, nodes=nodes, host_memory_bytes=host,
                           nvme_path=nvme, notes=notes)
    plan.search["seconds"] = time.perf_counter() - start
    return plan


def _with_offload(single: Plan, offload: Plan) -> Plan:
    """One GPU where nothing fits on it alone: the fastest offloading plan (ZeRO-Offload, ZeRO-3 / FSDP2 with CPU
    or NVMe offload) if one fits every tier; else the single-GPU report with what offload would need."""
    if offload.fits:
        offload.notes.append(f"nothing fits on one GPU alone ({(single.infeasible or {}).get('message', '')}); "
                             "the model states are offloaded to the host")
        return offload
    if single.infeasible is not None:
        single.infeasible["offload"] = (offload.infeasible or {}).get("message")
        single.infeasible["message"] += f"; with offload: {single.infeasible['offload']}"
    return single


CALIBRATION_MODES = ("use", "ignore", "clear")


def _calibrated(pol: Policy, prof: Profile, hw: HardwareSpec, budget_bytes: int, notes: list[str],
                mode: str = "use") -> Policy:
    """The policy with its margin widened by this model's measured / predicted ratio on this GPU kind, if any
    (``mode`` "ignore": unchanged; "clear": the stored calibration is deleted first)."""
    from memopt.guard.calibration import calibration_for, calibration_path, clear_calibration

    if mode == "clear":
        removed = clear_calibration(prof.key, hw.name)
        notes.append(f"calibration cleared ({removed} file(s) removed); planned without it")
        return pol
    if mode == "ignore":
        if calibration_for(prof.key, hw.name) is not None:
            notes.append("calibration ignored (calibration='ignore'): the margin is the policy's")
        return pol
    cal = calibration_for(prof.key, hw.name)
    if cal is None or not cal.entries:
        return pol
    base = pol.margin(budget_bytes)
    margin = cal.margin_bytes(budget_bytes, base)
    ratio = cal.ratio_total
    if margin <= base:
        notes.append(f"calibration used ({calibration_path(prof.key, hw.name)}): {len(cal.entries)} measured "
                     f"plan(s) of this model on {hw.name} stayed within their predictions; margin unchanged")
        return pol
    notes.append(f"calibration used ({calibration_path(prof.key, hw.name)}): measured totals ran up to "
                 f"{100 * (ratio - 1):.1f}% above prediction for this model on {hw.name}; margin widened from "
                 f"{format_bytes(base)} to {format_bytes(margin)}")
    return dataclasses.replace(pol, margin_bytes=margin, margin_fraction=0.0)


def _summary(ev: Evaluated) -> dict[str, Any]:
    est = ev.estimate
    return {"techniques": ev.strategy.to_dict(), "label": ev.strategy.label(), "fits": ev.fits,
            "total_bytes": ev.total_bytes, "step_time_s": est.step_time_s if est else None,
            "throughput": est.throughput if est else None}


def _rejections(best: Evaluated, evaluated: list[Evaluated], budget: int) -> tuple[dict[str, str], dict]:
    """For each technique, why its other values lost, and what the chosen value saves and costs."""
    rejected: dict[str, str] = {}
    savings: dict[str, dict[str, Any]] = {}
    chosen = best.strategy
    fields = ["precision", "checkpointing", "activation_offload", "attention", "chunked_ce", "optimizer",
              "micro_batch_size", "expandable_segments"]
    for f in fields:
        mine = getattr(chosen, f)
        others = [e for e in evaluated if getattr(e.strategy, f) != mine and (e.estimate is not None or e.floor_only)]
        if not others:
            continue
        reasons = []
        for value in sorted({_key(getattr(e.strategy, f)) for e in others}):
            group = [e for e in others if _key(getattr(e.strategy, f)) == value]
            fit = [e for e in group if e.fits]
            unsimulated = [e for e in group if e.fits is None]
            if fit:
                b = min(fit, key=lambda e: e.estimate.step_time_s)
                slower = b.estimate.step_time_s / best.estimate.step_time_s
                reasons.append(f"{value}: best fitting plan {slower:.2f}x the chosen step time")
            elif unsimulated:
                b = min(unsimulated, key=lambda e: e.estimate.step_time_s)
                slower = b.estimate.step_time_s / best.estimate.step_time_s
                reasons.append(f"{value}: {slower:.2f}x the chosen step time at best")
            else:
                smallest = min(group, key=lambda e: e.total_bytes)
                reasons.append(f"{value}: needs {format_bytes(smallest.total_bytes)} + margin at the least "
                               f"(budget {format_bytes(budget)})")
        rejected[f] = "; ".join(reasons)
        # the same plan with this technique at its "off" value: what the choice saves and costs
        off = {"checkpointing": Checkpointing(), "activation_offload": False, "chunked_ce": 0,
               "precision": "fp32", "optimizer": "adamw_fused", "attention": "auto",
               "expandable_segments": False}.get(f)
        if off is None or _key(off) == _key(mine):
            continue
        twin = next((e for e in evaluated if e.estimate is not None and e.strategy == chosen.replace(**{f: off})),
                    None)
        if twin is not None:
            savings[f] = {"saves_bytes": twin.estimate.total_bytes - best.estimate.total_bytes,
                          "costs_s": best.estimate.step_time_s - twin.estimate.step_time_s}
    return rejected, savings


def _key(value: Any) -> str:
    return value.label() if isinstance(value, Checkpointing) else str(value)


class _Estimates:
    """Estimates of one profile and hardware by strategy, quick (allocated bytes) and exact (allocator simulated):
    the infeasibility report asks for the same candidates under several policies, and the search has estimated
    some of them already. An estimate does not depend on the budget; ``fits`` is decided per call."""

    def __init__(self, prof: Profile, hw: HardwareSpec, seed: Sequence[Evaluated] = (),
                 store: EstimateStore | None = None) -> None:
        self.prof, self.hw = prof, hw
        self.store = store  # estimates of earlier plans of this profile (memopt.estimate.store)
        self.quick: dict[Strategy, Estimate | None] = {}
        self.exact: dict[Strategy, Evaluated] = {}
        self.above: dict[Strategy, int] = {}  # lower bounds of exact totals (replays stopped early), -1: none
        self.floors: dict = {}  # state_floor's cache
        for ev in seed:  # the allocated peak and runtime of an exact estimate are those of the quick one
            if ev.estimate is not None:
                self.quick[ev.strategy] = ev.estimate
                if ev.estimate.reserved_exact:
                    self.exact[ev.strategy] = ev

    def allocated_total(self, s: Strategy) -> int | None:
        """Allocated peak plus runtime bytes (a lower bound of the exact total), None if it cannot be estimated."""
        if s not in self.quick:
            stored = self.store.get(s, self.hw, exact=False) if self.store is not None else None
            if stored is not None:
                self.quick[s] = stored
            else:
                try:
                    self.quick[s] = estimate_strategy(self.prof, s, hardware=self.hw, exact_reserved=False)
                except EventStreamError:
                    raise
                except ValueError:
                    self.quick[s] = None
                if self.store is not None and self.quick[s] is not None:
                    self.store.put(s, self.hw, False, self.quick[s])
        q = self.quick[s]
        return None if q is None else q.peak_allocated_bytes + q.runtime_bytes

    def _exceeds(self, s: Strategy) -> int:
        """A total that ``s``'s exact total is known to reach (a replay stopped there, in this plan or a stored
        earlier one), -1 when none is known."""
        if s not in self.above:
            stored = self.store.get_bound(s, self.hw) if self.store is not None else None
            self.above[s] = -1 if stored is None else stored
        return self.above[s]

    def evaluate(self, s: Strategy, budget: int, margin: int, at_most: int | None = None) -> Evaluated | None:
        """The exact estimate of ``s``; with ``at_most``, None when its total is provably above that (the
        allocator replay stops there, and the bound it reached is kept for later calls)."""
        ev = self.exact.get(s)
        if ev is None:
            if at_most is not None and self._exceeds(s) > at_most:
                return None
            stored = self.store.get(s, self.hw, exact=True) if self.store is not None else None
            if stored is not None:
                ev = Evaluated(s, stored, None, stored.total_bytes)
            else:
                try:
                    ev = evaluate(self.prof, s, self.hw, budget, margin, stop_above=at_most)
                except TotalAbove as exc:
                    self.above[s] = max(self._exceeds(s), exc.total_bytes)
                    if self.store is not None:
                        self.store.put_bound(s, self.hw, self.above[s])
                    return None
                if self.store is not None and ev.estimate is not None:
                    self.store.put(s, self.hw, True, ev.estimate)
            self.exact[s] = ev
        if ev.estimate is None:
            return ev
        fits = ev.total_bytes + margin <= budget
        return Evaluated(s, ev.estimate, fits, ev.total_bytes, "" if fits else "reserved bytes exceed the budget")


def _level_fits(prof: Profile, hw: HardwareSpec, pol: Policy, ctx: SearchContext, budget: int,
                level: tuple, estimates: _Estimates) -> tuple[bool, int | None]:
    """Whether anything of this extras level may fit, and the smallest total found (``_min_footprint``: the
    trace-free floor of its model states when that exceeds the budget, else from estimates)."""
    margin = pol.margin(budget)
    cands = candidates(dataclasses.replace(ctx, max_micro_batch=1), pol, level)
    if not cands:
        return False, None
    ev = _min_footprint(prof, hw, pol, ctx, budget, estimates, level=level)
    if ev is None:
        return False, None
    if ev.floor_only:  # the level's model states alone exceed the budget
        return False, ev.total_bytes
    # the extremes are near the level's smallest footprint, not provably at it (a plan without offload, or with
    # a larger micro-batch, can be a little smaller): a level within 5% of fitting is searched in full
    return ev.total_bytes + margin <= budget * _LEVEL_SKIP_SLACK, ev.total_bytes


_LEVEL_SKIP_SLACK = 1.05


def _min_footprint(prof: Profile, hw: HardwareSpec, pol: Policy, ctx: SearchContext, budget: int,
                   estimates: _Estimates | None = None, level: tuple | None = None,
                   floors_only: bool = False, first_fit: bool = False) -> Evaluated | None:
    """The smallest total the policy can reach at extras ``level`` (None: any level), from the most memory-saving
    value of every technique. When even the smallest model-state floor (``memopt.plan.floors``) of the policy's
    candidates exceeds the budget (or with ``floors_only``), that floor, as a ``floor_only`` lower bound: nothing
    is traced or simulated.

    Of the candidates considered, the one with the smallest exact total wins (the first in candidate order on a
    tie). Their allocated totals are lower bounds of the exact ones, so candidates are simulated in the order of
    those bounds and the rest are skipped once a bound cannot beat the best found.

    ``first_fit`` (what allowing more would reach): the candidate likeliest to fit (bf16 compute, no activation
    offload) is estimated first, and if it fits it is the answer: a footprint the policy reaches and that fits,
    not necessarily its smallest (a 70B model's QLoRA candidates took 20 s to trace in full)."""
    cands = candidates(dataclasses.replace(ctx, max_micro_batch=1), pol, level)
    if not cands:
        return None
    est = estimates if estimates is not None else _Estimates(prof, hw)
    margin = pol.margin(budget)
    floor, at = min((state_floor(prof, s, hw, est.floors).total_bytes, i) for i, s in enumerate(cands))
    if floor + margin > budget or floors_only:  # every candidate's model states exceed the budget: no trace
        return Evaluated(cands[at], None, None if floor + margin <= budget else False, floor, FLOOR_REASON,
                         floor_only=True)

    # memory-saving extremes only: the most saving extras level, full checkpointing (if any), smallest micro-batch,
    # the most chunked loss, 8-bit optimizer states. Activation offload and paged states are tried both ways: their
    # pinned buffers and paged memory count in the total, so on a model whose weights dominate they add more than
    # they save
    def rank(s: Strategy) -> tuple:
        return (-extras_saving(s), s.checkpointing.mode != "full" or s.checkpointing.num_blocks is not None,
                -s.chunked_ce, s.optimizer not in ("adamw8bit", "paged_adamw8bit"), not s.expandable_segments)

    cands.sort(key=rank)
    head = [c for c in cands if rank(c) == rank(cands[0])][:16]
    if first_fit:
        likeliest = min(head, key=lambda c: (c.activation_offload, _COMPUTE_ORDER.get(c.precision, 9)))
        ev = est.evaluate(likeliest, budget, margin)
        if ev is not None and ev.fits:
            return ev
    bounds = sorted((b, i) for i, s in enumerate(head) if (b := est.allocated_total(s)) is not None)
    best: Evaluated | None = None
    best_i = -1
    for lower, i in bounds:
        if best is not None and (lower, i) > (best.total_bytes, best_i):
            break  # this and every later bound can only tie later in order or lose
        # to win, a total must be below the best's (or equal, earlier in order): the replay stops once it is not
        at_most = None if best is None else best.total_bytes - int(i > best_i)
        ev = est.evaluate(head[i], budget, margin, at_most)
        if ev is not None and ev.estimate is not None and (best is None
                                                           or (ev.total_bytes, i) < (best.total_bytes, best_i)):
            best, best_i = ev, i
    return best


# precisions by how small their activations are, for ``_min_footprint(first_fit=True)``
_COMPUTE_ORDER = {"bf16_pure": 0, "bf16_master": 1, "bf16_autocast": 2, "fp16_autocast": 3, "fp32": 4}


def _level_name(level: tuple[tuple[str, Any], ...]) -> str:
    from memopt.techniques.quantization import extras_label

    return extras_label(Strategy(extras=level)) if level else "full fine-tuning"


def _method_notes(best: Evaluated, result: SearchResult, budget: int, notes: list[str],
                  rejected: dict[str, str]) -> None:
    """Say that the training method changed, and why each higher-fidelity level was passed over."""
    from memopt.techniques.quantization import method_change_note

    reasons = []
    for level in result.levels_tried[:-1]:
        group = [e.total_bytes for e in result.evaluated + result.floored if e.strategy.extras == level]
        smallest = result.level_minimums.get(level)
        if smallest is not None:
            group.append(smallest)
        need = f"needs {format_bytes(min(group))} + margin at the least" if group else "nothing could be estimated"
        reasons.append(f"{_level_name(level)}: {need} (budget {format_bytes(budget)})")
    note = method_change_note(best.strategy)
    if note:
        notes.append(note + (" Chosen because nothing of higher fidelity fits: " + "; ".join(reasons) + "."
                             if reasons else " Chosen by the pins adapter_rank / quant_bits."))
    if reasons:
        rejected["extras"] = "; ".join(reasons)


def _build_plan(prof: Profile, hw: HardwareSpec, budget: int, pol: Policy, result: SearchResult, notes: list[str],
                seconds: float, store: EstimateStore | None = None, floors_only: bool = False) -> Plan:
    """The plan of a single-GPU search; where nothing fits, the report of the smallest footprint and of what
    allowing more would reach (``floors_only``: those reaches as trace-free model-state floors, not estimated)."""
    margin = pol.margin(budget)
    model = {"name": prof.model_name, "class": prof.model_class, "num_params": prof.num_params,
             "num_trainable_params": prof.num_trainable_params, "sample": prof.sample, "profile_key": prof.key}
    search_info = {"candidates": result.num_candidates, "evaluated": len(result.evaluated),
                   "pruned_as_slower": result.pruned_slower, "pruned_as_too_big": result.pruned_too_big,
                   "seconds": seconds, "search_s": result.seconds, "profile_trace_s": prof.trace_s}
    global_batch = int(prof.sample["batch_size"])
    notes = notes + [n for n in unestimated_notes(result) if n not in notes]
    if result.best is not None:
        best = result.best
        rejected, savings = _rejections(best, result.evaluated + result.floored, budget)
        if best.strategy.extras:
            _method_notes(best, result, budget, notes, rejected)
        feasible = [e for e in result.feasible if e is not best]
        return Plan(fits=True, strategy=best.strategy, budget_bytes=budget, margin_bytes=margin,
                    prediction=best.estimate.to_dict(), model=model, hardware=hw.name, policy=pol.to_dict(),
                    global_batch=global_batch, runners_up=[_summary(e) for e in feasible[:3]], rejected=rejected,
                    savings=savings, search=search_info, notes=notes)
    # nothing fits: report the smallest reachable footprint and what to allow to go lower
    ctx = _context(prof, hw, global_batch, pol, False)
    estimates = _Estimates(prof, hw, result.evaluated, store=store)
    smallest = _min_footprint(prof, hw, pol, ctx, budget, estimates)
    relax = []
    for allowance in ALLOWANCES:
        if allowance in pol.allow:
            continue
        relaxed = pol.relaxed(allowance)
        if allowance == "quantized_weights" and "adapters" not in pol.allow:
            relaxed, allowance = relaxed.relaxed("adapters"), "adapters+quantized_weights"  # QLoRA needs both
        try:
            ev = _min_footprint(prof, hw, relaxed, ctx, budget, estimates, floors_only=floors_only, first_fit=True)
        except ValueError:
            continue  # e.g. peft or bitsandbytes not installed
        if ev is not None and smallest is not None and ev.total_bytes < smallest.total_bytes:
            # a floor under the budget says nothing of fitting: not estimated
            fits = ev.fits if not ev.floor_only or ev.total_bytes + margin > budget else None
            relax.append({"allow": allowance, "reaches_bytes": ev.total_bytes, "fits": fits,
                          "lower_bound": ev.floor_only})
    reach = smallest.total_bytes if smallest is not None else None
    bound = smallest is not None and smallest.floor_only
    message = (f"needs {'at least ' if bound else ''}{format_bytes(reach)} with every allowed technique"
               f"{', for its model states alone plus the CUDA runtime (no activations yet)' if bound else ''} "
               f"(budget {format_bytes(budget)}, "
               f"margin {format_bytes(margin)})" if reach is not None else "no candidate could be estimated")
    for r in relax:
        if not r["lower_bound"]:
            message += f"; allowing {r['allow']} reaches {format_bytes(r['reaches_bytes'])}"
        elif r["fits"] is None:
            message += (f"; allowing {r['allow']}: its model states and the CUDA runtime take "
                        f"{format_bytes(r['reaches_bytes'])} (not estimated further)")
        else:
            message += f"; allowing {r['allow']} still needs at least {format_bytes(r['reaches_bytes'])}"
    if not any(r["fits"] for r in relax):
        message += "; beyond that: more GPUs (sharding), CPU/NVMe offload of model states, or a smaller batch"
    chosen = smallest if smallest is not None else (result.evaluated[0] if result.evaluated else None)
    if chosen is not None and chosen.estimate is not None:
        prediction = chosen.estimate.to_dict()
    elif chosen is not None and chosen.floor_only:
        prediction = state_floor(prof, chosen.strategy, hw).prediction()
    else:
        prediction = {"peak_allocated_bytes": 0, "peak_reserved_bytes": 0, "runtime_bytes": 0, "total_bytes": 0,
                      "step_time_s": 0.0, "breakdown": {}}
    return Plan(fits=False, strategy=chosen.strategy if chosen else Strategy(), budget_bytes=budget,
                margin_bytes=margin, prediction=prediction, model=model, hardware=hw.name, policy=pol.to_dict(),
                global_batch=global_batch, infeasible={"message": message, "smallest_total_bytes": reach,
                                                       "smallest_is_lower_bound": bound, "relaxations": relax},
                search=search_info, notes=notes)
