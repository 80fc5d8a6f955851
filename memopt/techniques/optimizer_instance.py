"""An optimizer the user built before ``memopt.wrap`` (``opt = torch.optim.AdamW(model.parameters(), lr=...)``, the
first lines of most plain PyTorch loops), taken as the recipe for the one memopt builds.

memopt builds its optimizer after the plan has changed the model (its weights cast, fp32 masters beside them), and
again for each candidate the autotune measures or plan the guard switches to, so it needs a recipe rather than an
instance. The instance gives one: its class, its parameter groups with every hyper-parameter (a group's own
learning rate, weight decay, betas; a scheduler's ``initial_lr``), and its state when it has one (a resumed run's
moments, loaded into the new optimizer so that nothing the user had is lost). The user's parameter ``k`` of the
model's ``parameters()`` order is memopt's parameter ``k``: a plan that trains other parameters than the model's
own (adapters) cannot follow an instance, and says so.

A learning-rate scheduler built on that instance is re-pointed at each optimizer memopt builds
(:func:`scheduler_factory`); its step count and base rates stay its own. memopt's step calls ``optimizer.step()``
and ``scheduler.step()`` with no argument, so an optimizer whose step needs a closure (LBFGS) and a scheduler whose
step needs a metric (ReduceLROnPlateau) are refused before anything trains (:func:`step_argument`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memopt.errors import InputError, UserArgumentError

#: param-group flags of torch's optimizers that pick a kernel, not the update
KERNEL_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})

__all__ = ["KERNEL_FLAGS", "closure_refusal", "has_unpassed_scheduler", "is_optimizer", "is_scheduler",
           "optimizer_factory", "scheduler_factory", "scheduler_refusal", "step_argument", "torch_optimizer",
           "user_optimizer"]


def is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer)


def is_scheduler(obj: Any) -> bool:
    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau))


def torch_optimizer(opt: Any) -> Any:
    """The optimizer that ``opt`` wraps as ``.optimizer`` (accelerate's ``AcceleratedOptimizer`` from
    ``accelerator.prepare``, nested to any depth), else ``opt``. The wrapper's constructor takes an optimizer, not
    parameter groups, and its own work (device placement, a GradScaler, skipping steps while accumulating) is what
    memopt's step does under its plan: the torch optimizer inside is the recipe, and its groups are the wrapper's."""
    while isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer) and opt.optimizer is not opt:
        opt = opt.optimizer
    return opt


def step_argument(obj: Any) -> str | None:
    """The first argument ``obj.step`` cannot be called without (LBFGS's ``closure``, ReduceLROnPlateau's
    ``metrics``), or None. Read from the class: an instance's ``step`` is re-wrapped by torch's schedulers."""
    try:
        params = list(inspect.signature(type(obj).step).parameters.values())[1:]  # less self
    except (TypeError, ValueError):  # no signature to read (a C extension): nothing to refuse on
        return None
    required = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                inspect.Parameter.KEYWORD_ONLY)
    return next((p.name for p in params if p.kind in required and p.default is inspect.Parameter.empty), None)


def closure_refusal(opt: Any, where: str) -> str | None:
    """Why ``opt`` (the optimizer ``where`` names) cannot train under memopt, or None: memopt's step runs each
    micro-batch's forward and backward once, then ``optimizer.step()`` with no closure to evaluate the loss again."""
    needed = step_argument(opt)
    if needed is None:
        return None
    return (f"{where} is a {type(opt).__name__}, whose step() needs a {needed} (a function that evaluates the loss "
            "again), but memopt's step runs each forward and backward once and then calls optimizer.step() without "
            "one: use an optimizer whose step() takes no closure (AdamW, SGD, ...)")


def scheduler_refusal(scheduler: Any, where: str) -> str | None:
    """Why ``scheduler`` (the scheduler ``where`` names) cannot be stepped by memopt, or None: memopt calls
    ``scheduler.step()`` after each optimizer step, with no argument."""
    needed = step_argument(scheduler)
    if needed is None:
        return None
    return (f"{where} is a {type(scheduler).__name__}, whose step() needs {needed!r} (a validation metric memopt "
            "does not have): leave lr_scheduler= out, build it on wrapped.optimizer after memopt.wrap and call "
            "sched.step(val_loss) yourself")


def has_unpassed_scheduler(opt: torch.optim.Optimizer) -> bool:
    """Whether a torch scheduler was built on ``opt`` (each marks ``opt.step`` when built, to check the order of the
    two steps), or on the optimizer inside ``opt``, a wrapper (:func:`torch_optimizer`). ``initial_lr`` in the groups
    is not asked: a state loaded from a scheduled run carries it too."""
    while not getattr(opt.step, "_wrapped_by_lr_sched", False):
        if torch_optimizer(opt) is opt:
            return False
        opt = opt.optimizer
    return True


def _is_fake(p: torch.Tensor) -> bool:
    return p.device.type == "meta" or type(p).__name__ == "FakeTensor"


def _other_parameters(planned: int, built_over: int) -> ValueError:
    return ValueError(f"the plan trains {planned} parameter tensors but the optimizer passed to memopt.wrap was built "
                      f"over the model's {built_over} (adapters or quantization replace them): pass "
                      "optimizer='adamw' or a callable params -> optimizer")


def optimizer_factory(opt: torch.optim.Optimizer, model: nn.Module) -> Callable[[list[nn.Parameter]], Any]:
    """``params -> optimizer`` that rebuilds ``opt`` (class, groups, hyper-parameters, state) over the parameters
    memopt passes: the model's trainable parameters, in ``model.parameters()`` order. An optimizer wrapper's
    recipe is the torch optimizer inside it (:func:`torch_optimizer`). The recipe keeps that optimizer as
    ``built_from``."""
    opt = torch_optimizer(opt)
    refusal = closure_refusal(opt, "optimizer=")
    if refusal is not None:
        raise InputError([refusal])
    position = {id(p): i for i, p in enumerate(model.parameters())}
    foreign = sum(1 for g in opt.param_groups for p in g["params"] if id(p) not in position)
    if foreign:
        raise ValueError(f"the optimizer passed to memopt.wrap holds {foreign} tensor(s) that are not parameters of "
                         "the model: build it over model.parameters(), or pass a callable params -> optimizer")
    trainable = [i for i, p in enumerate(model.parameters()) if p.requires_grad]
    groups = [({k: v for k, v in g.items() if k != "params"}, [position[id(p)] for p in g["params"]])
              for g in opt.param_groups]
    widest = max(groups, key=lambda g: len(g[1]))[0] if groups else {}
    trained = set(trainable)
    every_param_trained = all(i in trained for _, idx in groups for i in idx)
    state = opt.state_dict() if opt.state else None
    cls, defaults = type(opt), dict(opt.defaults)

    def construct(param_groups: list[dict[str, Any]] | list[nn.Parameter]) -> torch.optim.Optimizer:
        try:
            return cls(param_groups, **defaults)
        except TypeError:  # an optimizer whose defaults are not its constructor's keywords: the groups carry them
            return cls(param_groups)

    def build(params: Any) -> torch.optim.Optimizer:
        params = list(params)
        if len(params) != len(trainable):
            if not params or _is_fake(params[0]):
                # a trace of part of the model (a few blocks): the state it allocates is what matters
                return construct([{**widest, "params": params}])
            raise _other_parameters(len(params), len(trainable))
        at = dict(zip(trainable, params))
        new = construct([{**hp, "params": [at[i] for i in idx if i in at]} for hp, idx in groups])
        if state is not None and every_param_trained and not _is_fake(params[0]):
            new.load_state_dict(state)
        return new

    def as_variant(make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer], params: Any
                   ) -> torch.optim.Optimizer:
        """The optimizer ``make(param_groups)`` builds (a pinned variant of the same algorithm) over ``opt``'s
        groups and hyper-parameters, less the flags that pick a kernel (the variant picks its own), with ``opt``'s
        state loaded where it has one."""
        params = list(params)
        if len(params) != len(trainable):
            raise _other_parameters(len(params), len(trainable))
        at = dict(zip(trainable, params))
        new = make([{**{k: v for k, v in hp.items() if k not in KERNEL_FLAGS},
                     "params": [at[i] for i in idx if i in at]} for hp, idx in groups])
        if state is not None and every_param_trained:
            # a loaded group replaces the built one whole: keep the kernel the variant chose
            saved = {**state, "param_groups": [{**g, **{k: v for k, v in built.items() if k in KERNEL_FLAGS}}
                                               for g, built in zip(state["param_groups"], new.param_groups)]}
            new.load_state_dict(saved)
        return new

    build.built_from = opt  # type: ignore[attr-defined]  # a script may keep writing into it: wrap warns, once
    build.as_variant = as_variant  # type: ignore[attr-defined]  # an optimizer pin of the same algorithm
    return build


def scheduler_factory(scheduler: Any, opt: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], Any]:
    """``optimizer -> scheduler``: ``scheduler`` (built on ``opt``) re-pointed at the optimizer memopt built."""
    if torch_optimizer(scheduler.optimizer) is not torch_optimizer(opt):  # a wrapper's: built on it or inside it
        raise ValueError("the lr_scheduler passed to memopt.wrap was built on another optimizer than the one passed: "
                         "build it on that optimizer, or pass a callable optimizer -> scheduler")

    def bind(new: torch.optim.Optimizer) -> Any:
        _repoint(scheduler, new)
        _track_steps(new)
        return scheduler

    return bind


def _repoint(scheduler: Any, new: torch.optim.Optimizer) -> None:
    """``scheduler`` and every scheduler it drives (``SequentialLR``'s and ``ChainedScheduler``'s ``_schedulers``,
    nested to any depth) set the learning rate of ``new``: the inner ones write the rate, so an outer one re-pointed
    alone would leave them driving the user's optimizer. Their step counts are the objects' own, kept."""
    scheduler.optimizer = new
    for inner in getattr(scheduler, "_schedulers", None) or ():
        _repoint(inner, new)


def _track_steps(opt: torch.optim.Optimizer) -> None:
    """Mark ``opt.step`` as a scheduler built on ``opt`` would have (torch's schedulers warn on their first step when
    the optimizer's step was not wrapped by one, taking it for a step called in the wrong order)."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    step = opt.step

    def tracked(*args: Any, **kwargs: Any) -> Any:
        opt._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = tracked  # type: ignore[method-assign]


def user_optimizer(build: Callable[[list[nn.Parameter]], Any], params: list[nn.Parameter]) -> Any:
    """The optimizer the user's ``build(params)`` makes, checked: something with an optimizer's surface, over the
    parameters it was given and no others (one built over another module's parameters would step those: training
    would change nothing), whose step needs no closure. Raises ``UserArgumentError``: the user's argument, wrong for
    every candidate, which the planner does not take for a candidate that cannot run."""
    built = build(params)
    if not all(hasattr(built, name) for name in ("step", "zero_grad", "param_groups", "state_dict")):
        raise UserArgumentError(f"optimizer= returned a {type(built).__name__}, not an optimizer: pass a callable "
                                "params -> torch.optim.Optimizer, e.g. lambda params: torch.optim.AdamW(params, "
                                "lr=1e-4)")
    given = {id(p) for p in params}
    foreign = sum(1 for g in built.param_groups for p in g["params"] if id(p) not in given)
    if foreign:
        raise UserArgumentError(f"the optimizer optimizer= built holds {foreign} tensor(s) other than the parameters "
                                "it was given: build it over the parameters the callable receives (lambda params: "
                                "torch.optim.AdamW(params, ...)), not over another module's")
    refusal = closure_refusal(built, "the optimizer optimizer= built")
    if refusal is not None:
        raise UserArgumentError(refusal)
    return built
