"""The planner beyond one GPU's memory: data parallel, ZeRO-1/2/3, FSDP2 (hybrid across nodes), CPU and NVMe offload.

``plan_sharded`` enumerates, through the technique registry, the sharding entry's engine settings
(``memopt.techniques.extras.SHARDING.options``: ``ShardingSetting``s the policy's offload allowance admits) x the
checkpointing entry's coarse grid (``coarse``) x the micro-batch entry's options for the batch of one rank, predicts
each with the sharded estimate (``memopt.distributed.estimate``: the activation timeline joined with the engine's
bytes, reserved per allocator pool, and the step time with collectives, host copies and the CPU optimizer; a
``ShardedEstimate``), and returns the fastest candidate that fits every tier of the budget:

* GPU: predicted reserved peak + the memory outside the allocator (CUDA runtime, NCCL) + the policy's margin
  <= the per-GPU budget;
* host RAM per node (shared by the node's ranks: offloaded states, pinned buffers, the CPU optimizer's states)
  <= ``HOST_RAM_USABLE`` of the node's RAM (``HardwareSpec.host_memory_bytes``, else this machine's, less what its
  processes already hold beyond the model's own host copy: a host that runs out is killed, losing the run);
* NVMe per node <= the free space at ``nvme_path`` (NVMe settings are tried only with a path).

The engine is chosen by predicted speed where several can run a setting. A setting that fits the GPU but not host
RAM is not a plan. When nothing fits, the plan is infeasible and says what would (more GPUs, offload, an NVMe path).
Sharded plans run the precision and optimizer the sharding entry names (the engines' own mixed precision: bf16
compute, fp32 master weights and reductions; AdamW), so they need the ``bf16_autocast`` allowance (the default where
the GPU has bf16).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

from memopt.distributed.engine_bytes import EngineRun
from memopt.distributed.estimate import ShardedEstimate, compute_estimate, predict_sharded, sharded_time
from memopt.distributed.host_tier import machine_host_memory_bytes, machine_host_taken_bytes
from memopt.distributed.memory import fit_advice
from memopt.distributed.timeline import activation_timeline, timeline_grads
from memopt.errors import InputError
from memopt.hardware import HardwareSpec
from memopt.plan.context import micro_batch_refusal_for
from memopt.plan.policy import Policy
from memopt.plan.schema import Plan
from memopt.plan.search import bisect_blocks, checkpointed_blocks
from memopt.plan.sharded_cap import capped_if_needed
from memopt.profile.engine_facts import ModelFacts, facts_of_profile
from memopt.strategy import Checkpointing, Strategy
from memopt.techniques.extras import SHARDING
from memopt.techniques.protocol import SearchContext
from memopt.techniques.registry import BY_NAME
from memopt.techniques.sharding import ENGINE_PRECISION, ShardingSetting, sharding_settings
from memopt.units import format_bytes

# sharding_settings is re-exported: the GPU scripts list the settings from here
__all__ = ["HOST_RAM_USABLE", "ShardedCandidate", "launch_note", "plan_sharded", "predict_estimate",
           "predict_strategy", "sharding_settings", "world_of"]

# the registry entries whose values a sharded plan chooses besides the engine setting (Any: their protocols do not
# name the checkpointing entry's coarse grid)
_CHECKPOINTING: Any = BY_NAME["checkpointing"]
_MICRO_BATCH: Any = BY_NAME["micro_batch_size"]

# what a sharded plan runs but does not choose (the engine's own kernels and allocator setting), as its Strategy
# leaves them: a policy that forbids one leaves no sharded plan
_FIXED: dict[str, Any] = {name: getattr(Strategy(), name) for name in
                          ("activation_offload", "attention", "chunked_ce", "ce_kernel", "expandable_segments")}

#: the fraction of a node's RAM the offloaded states may take (the rest: the OS, data loaders, the ranks' Python)
HOST_RAM_USABLE = 0.9


def world_of(hw: HardwareSpec) -> tuple[int, int]:
    """(world size, nodes) a hardware spec describes."""
    nodes = max(1, hw.num_nodes)
    return max(1, hw.gpus_per_node) * nodes, nodes


@dataclass
class ShardedCandidate:
    """One (setting, checkpointing, micro-batch) with its prediction; ``fits`` over every tier."""

    setting: ShardingSetting
    strategy: Strategy
    prediction: ShardedEstimate  # replaced by its timed copy once the candidate fits
    fits: bool
    reason: str = ""

    @property
    def total_bytes(self) -> int:
        return int(self.prediction.total_bytes)

    @property
    def step_time_s(self) -> float:
        t = self.prediction.step_time_s
        return float("inf") if t is None else float(t)

    def label(self) -> str:
        return self.strategy.label()

    def summary(self) -> dict[str, Any]:
        """As the single-GPU planner's runners-up (``techniques``, ``label``, ``total_bytes``, ``step_time_s``)."""
        return {"techniques": self.strategy.to_dict(), "label": self.label(), "fits": self.fits,
                "total_bytes": self.total_bytes, "step_time_s": self.prediction.step_time_s,
                "host_bytes_per_node": self.prediction.host_bytes_per_node, "reason": self.reason}


def _fits_uncapped(c: ShardedCandidate) -> bool:
    return c.fits and c.prediction.capped is None


def _bisect_blocks(fits_at: dict[int, bool], fits: Any) -> None:
    """Between the fewest checkpointed blocks that fit in ``fits_at`` and the next fewer that do not, find the
    fewest that fit, calling ``fits(k)`` (which evaluates k)."""
    fit_ks = [k for k, ok in fits_at.items() if ok and k > 0]
    if fit_ks:
        hi = min(fit_ks)
        bisect_blocks(max((k for k, ok in fits_at.items() if not ok and k < hi), default=None), hi, fits)


def _rank_context(per_rank: int, n_blocks: int, hw: HardwareSpec, policy: Policy, refusal: str | None
                  ) -> SearchContext:
    """The search context of one rank's batch, for the registry's micro-batch options: the batch is the rank's
    share, ``refusal`` why micro-batches would not be exact (``micro_batch_refusal_for``). The fields for what a
    sharded plan does not search (kernels, losses, packages) name nothing it would use."""
    # a pinned micro-batch is the user's to choose even where it would not be exact (as in the single-GPU search)
    pinned = policy.pins.get("micro_batch_size") is not None
    return SearchContext(global_batch=per_rank, block_counts=(n_blocks,), supports_bf16=hw.supports_bf16,
                         causal_lm=False, vocab_size=None, bnb_available=False, flash_attn_available=False,
                         user_optimizer=False, max_micro_batch=policy.max_micro_batch or None,
                         micro_batch_refusal=None if pinned else refusal)


def _micro_batches_of(ctx: SearchContext, policy: Policy) -> list[int]:
    """The micro-batch entry's options for one rank, largest first (the fastest, tried first), as the policy allows
    (a pin allows only itself) and capped at ``max_micro_batch``: the entry keeps the whole batch of a model it may
    not split whatever its size, and the sharded planner has always capped that too."""
    return [b for b in sorted(_MICRO_BATCH.options(ctx), reverse=True) if policy.allows("micro_batch_size", b)
            and not (policy.max_micro_batch and b > policy.max_micro_batch)]


def _checkpointings_of(n_blocks: int, policy: Policy) -> list[Checkpointing]:
    """The checkpointing entry's coarse grid as the policy allows it; a ``checkpoint_blocks`` pin allows only its
    own count (as in the single-GPU search: 0 is no checkpointing)."""
    grid = [ck for ck in _CHECKPOINTING.coarse(n_blocks) if policy.allows("checkpointing", ck.mode)]
    blocks = policy.pins.get("checkpoint_blocks")
    if blocks is None:
        return grid
    pinned = [ck for ck in grid if checkpointed_blocks(ck, (n_blocks,)) == blocks]
    if not pinned and blocks > 0 and policy.allows("checkpointing", "full"):
        pinned = [Checkpointing(mode="full", num_blocks=blocks)]
    return pinned


class _SharedWork:
    """What candidates of different engines share at one (micro-batch, checkpointing): the activation timeline
    (per way of counting gradients) and the single-GPU compute estimate; each made once per plan."""

    def __init__(self, profile: Any, facts: ModelFacts, hw: HardwareSpec) -> None:
        self.profile, self.facts, self.hw = profile, facts, hw
        self._timelines: dict[tuple[Any, ...], Any] = {}
        self._compute: dict[tuple[Any, ...], Any] = {}

    def timeline(self, strategy: Strategy, setting: ShardingSetting) -> Any:
        grads = timeline_grads(setting)
        key = (strategy.micro_batch_size, strategy.checkpointing, grads)
        if key not in self._timelines:
            self._timelines[key] = activation_timeline(
                self.profile, strategy.replace(precision=ENGINE_PRECISION), grads=grads)
        return self._timelines[key]

    def step_s(self, strategy: Strategy, setting: ShardingSetting) -> float:
        key = (strategy.micro_batch_size, strategy.grad_accum_steps, strategy.checkpointing)
        if key not in self._compute:
            self._compute[key] = compute_estimate(self.profile, strategy, self.hw)
        run = EngineRun.of(setting, strategy.grad_accum_steps)
        return float(sharded_time(self.profile, strategy, run, self.facts, self.hw, self._compute[key]).step_s)


def _predict(shared: _SharedWork, strategy: Strategy, setting: ShardingSetting) -> ShardedEstimate:
    run = EngineRun.of(setting, strategy.grad_accum_steps)
    pred = predict_sharded(shared.profile, strategy, run, shared.facts, shared.timeline(strategy, setting))
    return ShardedEstimate.of(pred, setting, shared.hw.runtime_overhead_bytes)


def _step_time(shared: _SharedWork, strategy: Strategy, setting: ShardingSetting, pred: ShardedEstimate) -> float:
    """The step time of a (possibly capped) prediction: the engine's step plus the cap's allocator retries."""
    return shared.step_s(strategy, setting) + (pred.capped.retry_s if pred.capped is not None else 0.0)


def predict_estimate(profile: Any, hw: HardwareSpec, strategy: Strategy, budget_bytes: int, margin: int
                     ) -> ShardedEstimate:
    """Today's prediction of a sharded ``strategy`` (its ``extra('sharding')``) as the planner makes it: the
    per-GPU peaks and tiers, capped when only the hard cap makes it fit, and ``step_time_s``."""
    setting = ShardingSetting.from_any(strategy.extra("sharding"))
    shared = _SharedWork(profile, facts_of_profile(profile), hw)
    pred = capped_if_needed(_predict(shared, strategy, setting), strategy, budget_bytes, margin)
    return pred.replace(step_time_s=_step_time(shared, strategy, setting, pred))


def predict_strategy(profile: Any, hw: HardwareSpec, strategy: Strategy, budget_bytes: int, margin: int
                     ) -> dict[str, Any]:
    """:func:`predict_estimate` as the dict a plan records (``ShardedEstimate.to_dict``), for re-predicting saved
    plans against measurements (the scripts read it as saved plans are read)."""
    return predict_estimate(profile, hw, strategy, budget_bytes, margin).to_dict()


def _tiers_fit(pred: ShardedEstimate, budget: int, margin: int, host_ram: int, nvme_free: int | None,
               host_taken: int = 0) -> str:
    """'' when the prediction fits every tier, else why not."""
    if pred.total_bytes + margin > budget:
        return f"needs {format_bytes(pred.total_bytes)} per GPU (+ margin {format_bytes(margin)})"
    if pred.host_bytes_per_node + host_taken > HOST_RAM_USABLE * host_ram:
        taken = f", less the {format_bytes(host_taken)} this machine's processes hold" if host_taken else ""
        return (f"needs {format_bytes(pred.host_bytes_per_node)} of host RAM per node, more than "
                f"{HOST_RAM_USABLE:.0%} of {format_bytes(host_ram)}{taken}")
    if pred.nvme_bytes_per_node and (nvme_free is None or pred.nvme_bytes_per_node > nvme_free):
        return f"needs {format_bytes(pred.nvme_bytes_per_node)} of NVMe per node"
    return ""


def _engines_for(profile: Any, settings: list[ShardingSetting], notes: list[str]) -> list[ShardingSetting]:
    """The engines that can run this model as estimated. cuDNN runs a recurrent layer on its weights as one
    contiguous chunk; DeepSpeed keeps the weights as views of its flat buffers and FSDP2 gathers each shard into its
    own storage, so cuDNN copies every weight of the layer at each call (torch warns "RNN module weights are not
    part of single contiguous chunk of memory"): memory no estimate here holds, and on an H100 a GRU's one-GPU
    ZeRO-2 offload plan ran out of its cap in the first backward. DDP leaves the weights as they are."""
    layers = getattr(profile, "recurrent_layers", None) or []
    if not layers:
        return settings
    kept = [s for s in settings if s.engine == "ddp"]
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    why = (f"DeepSpeed and FSDP2 refused: the recurrent layers ({shown}) would no longer hold their weights as one "
           "contiguous chunk, and cuDNN would copy them at every call")
    if not kept:
        raise ValueError(why)
    notes.append(why)
    return kept


def plan_sharded(profile: Any, hw: HardwareSpec, budget_bytes: int, policy: Policy, *, world_size: int, nodes: int,
                 host_memory_bytes: int | None = None, nvme_path: str | None = None, notes: list[str] | None = None,
                 settings: list[ShardingSetting] | None = None,
                 host_reclaimable_bytes: int = 0) -> tuple[Plan, list[ShardedCandidate]]:
    """The fastest sharded / offloaded plan of ``profile`` on ``world_size`` GPUs that fits every tier.

    The profile's sample batch is the global batch, split evenly over the data-parallel ranks. Returns the plan and
    every candidate evaluated (fastest fitting first). Planned for this machine's RAM (no ``host_memory_bytes``
    given or in ``hw``), the host tier is what its processes do not hold already, counting
    ``host_reclaimable_bytes`` (the model's host copy, which the engine frees) as free.
    """
    notes = list(notes or [])
    if not policy.allows("precision", SHARDING.precision) or not hw.supports_bf16:
        raise InputError(["sharded and offloaded plans run the engines' bf16 mixed precision (fp32 master weights): "
                          "allow bf16 (fidelity 'default' on a GPU with bf16), or plan for one GPU"])
    if SHARDING.optimizer in policy.forbid.get("optimizer", ()):
        raise InputError([f"sharded and offloaded plans run the engines' AdamW (memopt's {SHARDING.optimizer}), "
                          "which forbid excludes: drop it from forbid, or plan for one GPU without offload"])
    for name, value in _FIXED.items():
        if value in policy.forbid.get(name, ()):
            raise InputError([f"sharded and offloaded plans run {name}={value!r}, which forbid excludes: drop it "
                              "from forbid, or plan for one GPU without offload"])
    global_batch = int(profile.sample["batch_size"])
    if global_batch % world_size:
        raise InputError([f"the global batch {global_batch} does not split over {world_size} GPUs: use a batch that "
                          f"is a multiple of {world_size}, or fewer GPUs"])
    host_ram = host_memory_bytes or hw.host_memory_bytes or machine_host_memory_bytes()
    host_taken = 0
    if not (host_memory_bytes or hw.host_memory_bytes):
        host_taken = machine_host_taken_bytes(host_reclaimable_bytes)
        held = f", of which {format_bytes(host_taken)} is held by its processes now" if host_taken else ""
        notes.append(f"host RAM per node taken from this machine ({format_bytes(host_ram)}{held}); set "
                     "hardware.host_memory_bytes for the machine you plan for")
    nvme_free = None
    if nvme_path:
        if not os.path.isdir(nvme_path):
            raise InputError([f"nvme_path {nvme_path!r} is not a directory: create it on a local NVMe drive or "
                              "leave it unset (no NVMe offload)"])
        nvme_free = shutil.disk_usage(nvme_path).free
    facts = facts_of_profile(profile)
    margin = policy.margin(budget_bytes)
    per_rank = global_batch // world_size
    shared = _SharedWork(profile, facts, hw)
    candidates: list[ShardedCandidate] = []
    if settings is None:
        settings = _engines_for(profile, SHARDING.options(world_size, nodes, policy, nvme_path=nvme_path), notes)
    n_blocks = len(facts.unit_params)
    micro_batches = _micro_batches_of(
        _rank_context(per_rank, n_blocks, hw, policy, micro_batch_refusal_for(profile, policy)), policy)
    checkpointings = _checkpointings_of(n_blocks, policy)

    def evaluate(setting: ShardingSetting, mb: int, ck: Checkpointing) -> ShardedCandidate:
        strategy = Strategy(precision=SHARDING.precision, checkpointing=ck, micro_batch_size=mb,
                            grad_accum_steps=per_rank // mb, optimizer=SHARDING.optimizer,
                            extras=(("sharding", setting.to_dict()),))
        pred = capped_if_needed(_predict(shared, strategy, setting), strategy, budget_bytes, margin)
        why = _tiers_fit(pred, budget_bytes, margin, host_ram, nvme_free, host_taken)
        candidates.append(ShardedCandidate(setting, strategy, pred, fits=not why, reason=why))
        return candidates[-1]

    def timed(c: ShardedCandidate) -> None:
        step_s = _step_time(shared, c.strategy, c.setting, c.prediction)
        if profile.tokens_per_sample:
            c.prediction = c.prediction.replace(step_time_s=step_s,
                                                tokens_per_s=global_batch * profile.tokens_per_sample / step_s)
        else:
            c.prediction = c.prediction.replace(step_time_s=step_s, samples_per_s=global_batch / step_s)

    coarse: dict[tuple[int, int], dict[int, ShardedCandidate]] = {}
    for i, setting in enumerate(settings):
        for mb in micro_batches:
            coarse[i, mb] = {ck.count(n_blocks): evaluate(setting, mb, ck) for ck in checkpointings}
    for c in candidates:
        if c.fits:
            timed(c)
    if policy.allows("checkpointing", "full") and policy.pins.get("checkpoint_blocks") is None:
        # the coarse grid checkpoints all, 3/4, 1/2 or 1/4 of the blocks: between the fewest that fit and the next
        # fewer that do not, the fewest that fit (memory falls as blocks are checkpointed), by bisection; once for
        # fitting outright and once for fitting under the cap (with allocator retries). Only for the engine and
        # micro-batch of the two fastest coarse plans: a finer count saves at most a fraction of one forward pass
        ranked = sorted(((c.step_time_s, key) for key, grid in coarse.items() for c in grid.values() if c.fits))
        best_keys = list(dict.fromkeys(key for _, key in ranked))[:2]
        for key in best_keys:
            grid = coarse[key]
            setting, mb = settings[key[0]], key[1]

            def at(k: int, grid: dict = grid, setting: ShardingSetting = setting, mb: int = mb) -> ShardedCandidate:
                if k not in grid:
                    grid[k] = evaluate(setting, mb, Checkpointing(mode="full", num_blocks=k))
                return grid[k]

            for ok in (_fits_uncapped, lambda c: c.fits):
                _bisect_blocks({k: ok(c) for k, c in grid.items()}, lambda k, ok=ok, at=at: ok(at(k)))
        for c in candidates:
            if c.fits and c.prediction.step_time_s is None:
                timed(c)
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: c.step_time_s)
    if not fitting and candidates:
        # the plan that does not fit is the smallest candidate, and carries its step time as the one-GPU planner's
        # does: a plan's prediction always has one (Plan.step_time_s, its JSON, the CLI's exit code read it)
        timed(min(candidates, key=lambda c: c.total_bytes))
    plan = _plan_of(profile, hw, budget_bytes, policy, fitting, candidates, notes, host_ram, nvme_path, facts)
    plan.search["host_memory_source"] = ("host_memory" if host_memory_bytes else "hardware.host_memory_bytes"
                                         if hw.host_memory_bytes else "this machine's RAM")
    return plan, fitting + [c for c in candidates if not c.fits]


def _plan_of(profile: Any, hw: HardwareSpec, budget: int, policy: Policy, fitting: list[ShardedCandidate],
             candidates: list[ShardedCandidate], notes: list[str], host_ram: int, nvme_path: str | None,
             facts: ModelFacts) -> Plan:
    world = candidates[0].setting.world_size if candidates else 1
    model = {"name": profile.model_name, "class": profile.model_class, "num_params": profile.num_params,
             "num_trainable_params": profile.num_trainable_params, "sample": profile.sample,
             "profile_key": profile.key}
    search = {"candidates": len(candidates), "evaluated": len(candidates), "pruned_as_slower": 0,
              "pruned_as_too_big": 0, "fitting": len(fitting), "world_size": world,
              "host_memory_bytes_per_node": host_ram, "profile_trace_s": profile.trace_s}
    common = {"budget_bytes": budget, "margin_bytes": policy.margin(budget), "model": model, "hardware": hw.name,
              "policy": policy.to_dict(), "global_batch": int(profile.sample["batch_size"]), "search": search}
    if fitting:
        best = fitting[0]
        engines = {}
        for c in fitting:  # the fastest of each engine, to say why the others lost
            engines.setdefault(_engine_name(c.setting), c)
        rejected = {name: f"{c.label()} predicted {c.step_time_s:.3f} s/step, slower than {best.step_time_s:.3f} s"
                    for name, c in engines.items() if c is not best}
        return Plan(fits=True, strategy=best.strategy, prediction=best.prediction.to_dict(),
                    runners_up=[c.summary() for c in fitting[1:4]], rejected=rejected,
                    notes=[*notes, launch_note(best.setting)], **common)
    smallest = min(candidates, key=lambda c: c.total_bytes) if candidates else None
    message = _infeasible_message(smallest, budget, policy, world, nvme_path, facts, hw, host_ram)
    return Plan(fits=False, strategy=smallest.strategy if smallest else Strategy(),
                prediction=smallest.prediction.to_dict() if smallest else {}, notes=notes,
                infeasible={"message": message, "smallest_total_bytes": smallest.total_bytes if smallest else None,
                            "relaxations": []}, **common)


def launch_note(setting: ShardingSetting) -> str:
    """How to run a sharded plan: the launcher line, and the exports for users who keep their own launcher."""
    per_node = setting.gpus_per_node
    if setting.nodes > 1:
        cmd = (f"torchrun --nnodes {setting.nodes} --nproc-per-node {per_node} --rdzv-backend c10d "
               "--rdzv-endpoint HEAD_NODE:29500 train.py")
    else:
        cmd = f"torchrun --nproc-per-node {per_node} train.py"
    exports = ("memopt.distributed.export_deepspeed_json(plan, 'ds_config.json')" if setting.engine == "deepspeed"
               else "memopt.distributed.export_accelerate_config(plan, 'accelerate.yaml')")
    return (f"launch: {cmd} (memopt.wrap(model, plan=plan) applies {setting.label()} in each process); with your "
            f"own launcher: {exports}")


def _engine_name(setting: ShardingSetting) -> str:
    name = setting.engine if setting.engine != "deepspeed" else f"zero{setting.stage}"
    return name + (" offload" if setting.offloads else "")


def _infeasible_message(smallest: ShardedCandidate | None, budget: int, policy: Policy, world: int,
                        nvme_path: str | None, facts: ModelFacts, hw: HardwareSpec, host_ram: int) -> str:
    if smallest is None:
        return "no sharded candidate could be made (the policy forbids every checkpointing and micro-batch)"
    head = (f"no sharding or offload on {world} GPU(s) fits: the smallest is {smallest.label()} at "
            f"{format_bytes(smallest.total_bytes)} per GPU ({smallest.reason})")
    other = smallest.prediction.runtime_bytes + smallest.prediction.activations_bytes
    advice = fit_advice(facts.num_params, budget_bytes=budget - policy.margin(budget), world_size=world,
                        gpus_per_node=max(1, hw.gpus_per_node), other_bytes=other,
                        unit_params=max(facts.unit_params, default=0), host_ram_bytes=host_ram)
    if not nvme_path:
        advice += "; NVMe offload is tried only with a path (hardware.extra.nvme_path=/mnt/nvme)"
    return f"{head}. What would: {advice}"
