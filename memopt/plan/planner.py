"""``memopt.plan(model, sample=..., budget="40GB")``: the fastest strategy that fits, and why."""

from __future__ import annotations

import itertools
import time
from typing import Any

from torch import nn

from memopt.estimate.store import EstimateStore
from memopt.hardware import HardwareSpec, default_hardware_note
from memopt.models import load_model_spec
from memopt.plan import checks
from memopt.plan.calibrate import CALIBRATION_MODES, calibrated
from memopt.plan.checks import check_pins_honoured, profile_fingerprint
from memopt.plan.context import refused_optimizer_notes, resolve_policy, search_context
from memopt.plan.footprint import Estimates, level_fits
from memopt.plan.model_keys import check_model_keys
from memopt.plan.plan_build import alternative_plans, build_plan
from memopt.plan.policy import Policy
from memopt.plan.policy_room import check_micro_batch_room, check_policy_room
from memopt.plan.schema import Plan
from memopt.plan.search import search
from memopt.plan.sharded import plan_sharded, world_of
from memopt.profile.api import profile_model
from memopt.profile.profile import Profile
from memopt.step.batch import as_loss
from memopt.techniques.adapter_merge import task_heads
from memopt.techniques.optimizer_instance import is_optimizer, optimizer_factory
from memopt.techniques.optimizers import VARIANTS, optimizer_choice, pinned_variant_refusal
from memopt.units import format_bytes, parse_bytes

__all__ = ["make_plan"]


def make_plan(model: Any, sample: Any = None, *, budget: str | int | float, hardware: Any = None,
              policy: Policy | dict[str, Any] | None = None, fidelity: Any = None, pins: dict[str, Any] | None = None,
              forbid: dict[str, Any] | None = None, optimizer: Any = None, loss_fn: Any = None,
              training_step: Any = None, profile: Profile | None = None, use_cache: bool = True,
              use_calibration: bool = True, calibration: str = "use", world_size: int | None = None,
              nodes: int | None = None, host_memory: str | int | None = None, nvme_path: str | None = None,
              attribute: bool = True, alternatives_within: float | None = None) -> Plan:
    """Plan the fastest strategy for training ``model`` on ``sample`` that fits ``budget`` per GPU.

    ``model`` and ``sample`` are what ``memopt.profile`` takes (a module, a shipped model name, ...). The
    sample's batch size is the global batch; micro-batching keeps it. ``budget`` follows DEVELOPERS.md
    ("40GB", "40GiB", "80%", bytes). ``policy`` (or ``fidelity``/``pins``/``forbid``) says what may change.
    ``optimizer`` is a callable taking the parameters when the user brings their own optimizer. ``loss_fn`` /
    ``training_step``: how the loss is made (``memopt.step.batch``), as in ``memopt.wrap``.
    ``calibration``: "use" (default): where earlier clean runs of this model on this GPU kind measured more than was
    predicted (``memopt.estimate.calibration``, written by ``memopt.wrap``'s guard), widen the margin by that ratio
    and say so in the plan's notes; "ignore": plan without it; "clear": delete this model's stored calibration on
    this GPU kind first (``use_calibration=False`` is "ignore"). ``hardware``: a shipped name, a dict or a
    ``HardwareSpec``; "auto" the local GPU; not given: the local GPU, else ``memopt.hardware.DEFAULT_HARDWARE``
    (the notes say so). Every argument is checked first; bad input raises one ``ValueError`` listing each
    problem on its own line (``memopt.plan.checks``).

    Beyond one GPU (``memopt.plan.sharded``): ``world_size`` GPUs over ``nodes`` nodes (default: the hardware
    spec's ``gpus_per_node x num_nodes``) are planned with DDP, ZeRO-1/2/3, FSDP2 (hybrid across nodes) and CPU /
    NVMe offload, the engine chosen by predicted speed; on one GPU, offload is planned when nothing else fits.
    ``host_memory``: RAM per node (default: the spec's ``host_memory_bytes``, else this machine's); ``nvme_path``: a
    directory on a local NVMe drive for ZeRO-Infinity (default: the spec's ``extra["nvme_path"]``; none: no NVMe).
    ``attribute``: put where every byte of the chosen plan goes into ``prediction["attribution"]`` (False for a
    candidate that may be thrown away: the autotune's re-plans attribute only the plan they keep).
    ``alternatives_within``: also search every fitting plan of the chosen plan's optimizer, allocator mode, precision
    and method predicted within that fraction of its step time, and give them (at most 4, fastest first) as
    ``plan.alternatives``, for the autotune to measure (one-GPU plans; the chosen plan is the same either way).
    """
    start = time.perf_counter()
    if training_step is not None:  # (model, batch) -> loss: the batch contract of memopt.step.batch
        loss_fn = as_loss(loss_fn, training_step)
    if is_optimizer(optimizer) and isinstance(model, nn.Module):  # one the user built: the recipe it gives
        optimizer = optimizer_factory(optimizer, model)
    if callable(optimizer) and not isinstance(optimizer, str) and isinstance(pins, dict):
        refusal = pinned_variant_refusal(optimizer, pins.get("optimizer"))
        checks.raise_problems([refusal] if refusal else [], "pins")
    if isinstance(optimizer, str) and optimizer in checks.OPTIMIZER_NAMES:  # a name, as wrap takes it: a pin or none
        pins = {**optimizer_choice(optimizer)[0], **(pins or {})}
        optimizer = None
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
        checks.raise_problems([
            f"budget {format_bytes(budget_bytes)} is below what the CUDA runtime alone holds on {hw.name} "
            f"({format_bytes(hw.runtime_overhead_bytes)} outside PyTorch's allocator); give at least "
            f"{format_bytes(hw.runtime_overhead_bytes + pol.margin(budget_bytes) + (1 << 30))}"], "budget")
    if budget_bytes > hw.memory_bytes:  # a plan for memory the device does not have would not run on it
        notes.append(f"the budget {format_bytes(budget_bytes)} is more than {hw.name} has "
                     f"({format_bytes(hw.memory_bytes)}): planned for the device's {format_bytes(hw.memory_bytes)}")
        budget_bytes = hw.memory_bytes
    prof = profile if profile is not None else profile_model(model, sample, hardware=hw, loss_fn=loss_fn,
                                                             optimizer=optimizer, use_cache=use_cache)
    if prof.sample.get("variable_length"):
        notes.append(f"batches vary in length: planned for the longest (seq_len={prof.sample.get('seq_len')})")
    notes.extend(prof.notes)
    pin_problems: list[str] = []
    checks.check_checkpoint_pins(pol.pins, prof, pin_problems)
    checks.raise_problems(pin_problems, "pins")
    pol = calibrated(pol, prof, hw, budget_bytes, notes, calibration)
    global_batch = int(prof.sample["batch_size"])
    _check_batch(pol, global_batch, world_size or world_of(hw)[0])
    ctx = search_context(prof, hw, global_batch, pol, optimizer is not None and not isinstance(optimizer, str))
    pinned_optimizer = dict(ctx.optimizer_refusals).get(pol.pins.get("optimizer"))
    if pinned_optimizer is not None:
        instead = VARIANTS[pol.pins["optimizer"]].instead
        checks.raise_problems([f"pin optimizer={pol.pins['optimizer']!r} cannot be honoured: {pinned_optimizer}; "
                               + (f"pin {instead!r} (the same update) or drop the pin" if instead else
                                  "drop the pin")], "pins")
    if pol.pins.get("chunked_ce") and (refusal := _chunked_ce_pin_refusal(prof)):
        checks.raise_problems([f"pin chunked_ce={pol.pins['chunked_ce']} cannot be honoured: {refusal}; drop the pin"],
                              "pins")
    notes.extend(refused_optimizer_notes(ctx, pol))
    if ctx.adapters_refusal is not None and pol.allow & {"adapters", "quantized_weights"}:
        notes.append(f"adapters refused: {ctx.adapters_refusal}")
    if ctx.micro_batch_refusal != prof.micro_batch_refusal and global_batch > 1:
        pinned = pol.pins.get("micro_batch_size")
        if pinned is not None and pinned < global_batch:
            notes.append(f"micro_batch_size={pinned} is pinned, so the batch is split although the split is not exact "
                         f"under fidelity 'exact': {ctx.micro_batch_refusal}")
        else:
            notes.append(f"micro-batching refused under fidelity 'exact': {ctx.micro_batch_refusal}; allow bf16 "
                         "autocast (fidelity 'default') or pin micro_batch_size to split the batch anyway")
    store = EstimateStore(prof) if use_cache else None
    estimates = Estimates(prof, hw, store=store)

    def level_check(level: tuple) -> tuple[bool, int | None]:
        return level_fits(prof, hw, pol, ctx, budget_bytes, level, estimates)

    world, n_nodes = world_of(hw)
    world, n_nodes = world_size or world, nodes or (n_nodes if world_size is None else 1)
    host = parse_bytes(host_memory) if host_memory is not None else None
    nvme = nvme_path or hw.extra.get("nvme_path")
    reclaimable = host_copy_bytes(model)
    with prof.batched_saves():  # the traces this plan adds are written to the cache once, at the end
        if world > 1:  # every candidate is a sharded one (DDP included)
            plan = _sharded(prof, hw, budget_bytes, pol, notes, world, n_nodes, host, nvme, start, reclaimable)
        else:
            result = search(prof, hw, budget_bytes, pol, ctx, level_check=level_check,
                            keep_within=alternatives_within)
            offload, offload_refused = None, None
            if result.best is None and pol.allows("offload", True) and pol.allows("precision", "bf16_autocast") \
                    and hw.supports_bf16:
                try:
                    offload = _sharded(prof, hw, budget_bytes, pol, list(notes), 1, 1, host, nvme, start,
                                       reclaimable)
                except ValueError as exc:  # the model cannot run as the engine runs it: the single-GPU report stands
                    offload_refused = f"offloading the model states to the host was not possible: {exc}"
                    notes.append(offload_refused)
            # where an offload plan answers, the single-GPU report is only a note: its relaxations are given by
            # their trace-free floors
            plan = build_plan(prof, hw, budget_bytes, pol, result, notes, time.perf_counter() - start, store,
                              floors_only=offload is not None and offload.fits)
            if offload is not None:
                plan = _with_offload(plan, offload)
            elif offload_refused and plan.infeasible is not None:
                plan.infeasible["message"] += f"; {offload_refused}"
            if attribute:
                # lazy: keeps memopt.estimate.attribution out of import memopt
                from memopt.estimate.attribution import attach_to_plan

                attach_to_plan(plan, prof, hw)  # where every byte of the chosen plan goes (report, output=json)
    if store is not None:
        store.save()
    heads = task_heads(model) if isinstance(model, nn.Module) and plan.strategy.extra("adapters") is not None else []
    if heads:
        plan.notes.append(f"the task head ({', '.join(heads)}) trains beside the adapters, made fresh for the task "
                          "as it is (peft's task types keep it trainable too: modules_to_save); its states are "
                          "counted in the plan")
    plan.model["fingerprint"] = profile_fingerprint(prof)
    check_pins_honoured(plan, pol.pins)
    if alternatives_within is not None and world == 1:
        plan.alternatives = alternative_plans(plan, result, alternatives_within)
    return plan


def _checked_args(model: Any, sample: Any, *, budget: Any, hardware: Any, policy: Any, fidelity: Any, pins: Any,
                  forbid: Any, optimizer: Any, calibration: Any, world_size: Any, nodes: Any, host_memory: Any,
                  nvme_path: Any) -> tuple[HardwareSpec, int, Policy]:
    """Every argument of ``make_plan`` checked before anything is traced: (hardware, budget bytes, policy), or
    one ``InputError`` (a ValueError) listing every problem."""
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
    if pol is not None and hw is not None:
        check_policy_room(pol, hw, problems, user_optimizer=optimizer is not None and not isinstance(optimizer, str))
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
        check_model_keys(spec, problems)
    if isinstance(sample, dict) and pol is not None:
        checks.check_global_batch_pins(pol.pins, sample.get("batch_size"), problems, key="pins.micro_batch_size",
                                       batch_key="sample batch_size")
    if pol is not None and hw is not None:
        batch = sample.get("batch_size") if isinstance(sample, dict) else None
        if batch is None and spec is not None:  # the spec's typical sample fills what the sample leaves out
            batch = spec.sample.get("batch_size")
        _check_micro_batch_room(pol, batch, world_size if isinstance(world_size, int) else world_of(hw)[0], problems)
    checks.raise_problems(problems, "arguments")
    assert hw is not None and budget_bytes is not None and pol is not None
    return hw, budget_bytes, pol


def _spec_of(model: Any) -> Any:
    """The model spec behind a shipped name / YAML path / dict / ModelSpec, else None (a module, a callable)."""
    if isinstance(model, (str, dict)) or type(model).__name__ == "ModelSpec":
        if isinstance(model, dict) and "_target_" in model:
            return None
        try:
            return load_model_spec(model)
        except (ValueError, TypeError, OSError):
            return None  # profile_model reports it
    return None


def _chunked_ce_pin_refusal(prof: Profile) -> str | None:
    """Why chunked cross-entropy cannot be planned for this model (None: it can): it replaces a Hugging Face causal
    LM's own head and loss, so any other model (a seq2seq or masked LM, a plain module with its own loss) has
    nothing it applies to, and a causal LM whose head it would not reproduce exactly is refused by the profile."""
    if prof.family != "causal_lm":
        return (f"{prof.model_class} is not a Hugging Face causal LM, and chunked cross-entropy fuses the head and "
                "loss of one (a *ForCausalLM model computing its own loss from labels)")
    if prof.chunked_ce_refusal:
        return f"chunked cross-entropy would not be exact for this model ({prof.chunked_ce_refusal})"
    return None


def _check_batch(pol: Policy, global_batch: int, world: Any) -> None:
    """A pinned micro-batch against the profile's global batch (per rank on several GPUs)."""
    problems: list[str] = []
    per_rank = global_batch // world if isinstance(world, int) and world > 1 and global_batch % world == 0 \
        else global_batch
    checks.check_global_batch_pins(pol.pins, per_rank, problems,
                                   batch_key="the batch per GPU" if per_rank != global_batch else "batch_size")
    checks.raise_problems(problems, "pins")
    _check_micro_batch_room(pol, global_batch, world, problems)
    checks.raise_problems(problems, "policy")


def _check_micro_batch_room(pol: Policy, batch: Any, world: Any, problems: list[str]) -> None:
    """The policy's micro-batch sizes against the batch of one GPU (the global batch split over ``world`` ranks
    where it splits; a batch that does not is reported by the sharded planner)."""
    if isinstance(batch, int) and isinstance(world, int) and world > 1 and batch % world == 0:
        check_micro_batch_room(pol, batch // world, problems, batch_key="the batch per GPU")
    else:
        check_micro_batch_room(pol, batch, problems)


def host_copy_bytes(model: Any) -> int:
    """Bytes of the model's parameters and buffers in host memory, which an engine frees as it moves them to the
    GPU or into its own layout (0 for anything but a module)."""
    if not isinstance(model, nn.Module):
        return 0
    storages = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.device.type == "cpu":
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _sharded(prof: Profile, hw: HardwareSpec, budget: int, pol: Policy, notes: list[str], world: int, nodes: int,
             host: int | None, nvme: str | None, start: float, reclaimable: int = 0) -> Plan:
    plan, _ = plan_sharded(prof, hw, budget, pol, world_size=world, nodes=nodes, host_memory_bytes=host,
                           nvme_path=nvme, notes=notes, host_reclaimable_bytes=reclaimable)
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
