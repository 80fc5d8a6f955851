"""A fake-tensor copy of the user's model: same structure, no memory, never touching the original.

``fake_copy`` deep-copies the module tree with every parameter and buffer replaced by a meta tensor
(so a real 70B model costs nothing to copy), then materializes them as fake tensors on the traced
device inside ``FakeTensorMode``. ``to_empty`` unties shared weights; ties are recorded first and
restored after. Optionally a stack of identical blocks is truncated to a few blocks: the profile
traces those and composes the rest. A model that reads a truncated stack's blocks by position past the kept ones
(MarkupLM's per-depth embeddings, ``for i in range(config.max_depth)``) gets :class:`TruncatedStackIndexed`
naming the stack, which the trace then keeps whole.

What the copy cannot reach is the process: caches in the model's code (``memopt.profile.process_caches``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memopt.blocks import BlockStack, find_block_stacks, tied_parameter_groups

__all__ = ["TruncatedStackIndexed", "fake_copy", "grads_kept", "train_as_given", "truncate_stacks"]


class TruncatedStackIndexed(IndexError):
    """The model read block ``index`` of a stack that the copy truncated to ``kept`` blocks: that stack has to be
    copied whole (``fake_copy(..., keep_whole=...)``)."""

    def __init__(self, path: str, index: int, kept: int) -> None:
        super().__init__(f"block {index} of {path!r} read by position, past the {kept} blocks kept for tracing")
        self.path = path


class _IndexedPastTheCut:
    """A truncated stack's container: reading a block past the kept ones says which stack to copy whole."""

    _memopt_path = ""

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, int) and not -len(self) <= idx < len(self):  # type: ignore[arg-type]
            raise TruncatedStackIndexed(self._memopt_path, idx, len(self))  # type: ignore[arg-type]
        return super().__getitem__(idx)  # type: ignore[misc]


class _TruncatedModuleList(_IndexedPastTheCut, nn.ModuleList):
    pass


class _TruncatedSequential(_IndexedPastTheCut, nn.Sequential):
    pass


class _TruncatedModuleDict(nn.ModuleDict):
    """A truncated ``ModuleDict`` stack: reading a dropped block by its key says which stack to copy whole."""

    _memopt_path = ""
    _memopt_dropped: tuple[str, ...] = ()

    def __getitem__(self, key: str) -> nn.Module:
        if key in self._memopt_dropped:
            raise TruncatedStackIndexed(self._memopt_path, len(self) + self._memopt_dropped.index(key), len(self))
        return super().__getitem__(key)


def _meta_memo(model: nn.Module) -> dict[int, object]:
    memo: dict[int, object] = {}
    for p in model.parameters(recurse=True):
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                       requires_grad=p.requires_grad)
    for b in model.buffers(recurse=True):
        if id(b) not in memo:
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return memo


def _retie(model: nn.Module, groups: list[list[str]]) -> None:
    for names in groups:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            setattr(owner, attr, first)


class _Dropped(nn.Module):
    """Stands in, during the copy, for blocks that a truncated copy will not keep."""


def _fake_like(t: torch.Tensor, fake_mode: FakeTensorMode, device: str | torch.device) -> torch.Tensor:
    with fake_mode:
        out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else out


@contextlib.contextmanager
def _tensors_copy_as_fakes(fake_mode: FakeTensorMode, device: str | torch.device) -> Iterator[None]:
    """While active, deep-copying any tensor the memo does not map yields a fake one: whatever the copy reaches
    (a plain tensor attribute, an optimizer's states behind a hook's bound method) costs no real memory. A copy
    of a model already on the GPU would otherwise allocate there, under the budget's cap."""
    saved = torch.Tensor.__deepcopy__, nn.Parameter.__deepcopy__
    torch.Tensor.__deepcopy__ = lambda self, memo: memo.setdefault(id(self), _fake_like(self, fake_mode, device))
    nn.Parameter.__deepcopy__ = torch.Tensor.__deepcopy__
    try:
        yield
    finally:
        torch.Tensor.__deepcopy__, nn.Parameter.__deepcopy__ = saved


def _is_hook_registry(name: str) -> bool:
    return name.endswith(("_hooks", "_hooks_with_kwargs", "_hooks_always_called"))


def _copy_modules(model: nn.Module, memo: dict[int, object]) -> nn.Module:
    """Module by module: every module of the tree gets an empty clone first (so any attribute that refers to a
    module, a bound method or a partial of one, copies to the clone), then each clone's attributes. Hook
    registries are shallow-copied (the callables are shared, the clone's own hooks stay its own); an attribute that
    cannot be deep-copied (an open file, a lock, a process handle) is shared, since tracing only reads it."""
    originals: list[nn.Module] = []
    pending = [model]
    while pending:  # not model.modules(): blocks the memo already maps (dropped ones) are not descended into
        m = pending.pop()
        if id(m) in memo:
            continue
        memo[id(m)] = m.__class__.__new__(m.__class__)
        originals.append(m)
        pending.extend(c for c in m._modules.values() if c is not None)
    for m in originals:
        clone = memo[id(m)]
        for key, value in m.__dict__.items():
            if key == "_modules":
                new: object = {n: (memo[id(c)] if c is not None else None) for n, c in value.items()}
            elif key in ("_parameters", "_buffers"):
                new = {n: (copy.deepcopy(t, memo) if t is not None else None) for n, t in value.items()}
            elif _is_hook_registry(key) and isinstance(value, dict):
                new = type(value)(value)
            else:
                try:
                    new = copy.deepcopy(value, memo)
                except Exception:
                    new = value
            clone.__dict__[key] = new
    return memo[id(model)]  # type: ignore[return-value]


def fake_copy(model: nn.Module, fake_mode: FakeTensorMode, device: str | torch.device,
              keep_blocks: int | None = None, keep_whole: Collection[str] = ()) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers are fake tensors on ``device``.

    No real memory is taken, wherever the model lives (a model already on the GPU included). With
    ``keep_blocks``, stacks of interchangeable blocks keep only their first ``keep_blocks`` blocks; the
    others are never copied (an 80-block model costs what a 4-block one does); the stacks named in ``keep_whole``
    keep all their blocks. Reading a truncated stack's block past the kept ones raises
    :class:`TruncatedStackIndexed`.
    """
    groups = tied_parameter_groups(model)
    memo = _meta_memo(model)
    cut: list[str] = []
    if keep_blocks is not None:
        dropped = _Dropped()
        for stack in find_block_stacks(model):
            # a run among other layers is traced whole: dropping blocks from the middle of its container would
            # renumber the layers after them, which other stacks' paths and tied parameters' names refer to
            if len(stack) > keep_blocks and stack.uniform_tail and stack.start is None \
                    and stack.path and stack.path not in keep_whole:
                cut.append(stack.path)
                for block in stack.blocks[keep_blocks:]:
                    memo[id(block)] = dropped
    try:
        with _tensors_copy_as_fakes(fake_mode, device):
            clone = _copy_modules(model, memo)
    except Exception as exc:
        raise ValueError(
            f"memopt could not copy the model for tracing ({type(exc).__name__}: {exc}). "
            "Build the model on the meta device (with torch.device('meta'): model = ...) and pass that"
        ) from exc
    for path in cut:
        parent_name, _, attr = path.rpartition(".")
        parent = clone.get_submodule(parent_name) if parent_name else clone
        container = getattr(parent, attr)
        short: nn.Module
        if isinstance(container, nn.ModuleDict):
            short = _TruncatedModuleDict({k: b for k, b in container.items() if not isinstance(b, _Dropped)})
            short._memopt_dropped = tuple(k for k, b in container.items() if isinstance(b, _Dropped))
        else:
            kept = [b for b in container if not isinstance(b, _Dropped)]
            short = _TruncatedSequential(*kept) if isinstance(container, nn.Sequential) else _TruncatedModuleList(kept)
        short._memopt_path = path
        setattr(parent, attr, short)
    if cut:
        groups = [[n for n in names if _resolvable(clone, n)] for names in groups]
        groups = [g for g in groups if len(g) > 1]
    with fake_mode:
        clone.to_empty(device=device)
    _retie(clone, groups)
    return clone


def train_as_given(clone: nn.Module, model: nn.Module) -> None:
    """The copy in the modes its training step runs in: the user's own per-module modes where the model is in training
    mode (a BatchNorm or a teacher kept in eval trains as such, and memopt's step leaves modes as they are); every
    module in training mode where the model is not (a model fresh from ``from_pretrained`` is in eval mode, and its
    user switches it to training before the loop: the trace counts dropout's masks)."""
    if not model.training:
        clone.train()


@contextlib.contextmanager
def grads_kept(model: nn.Module, *others: nn.Module) -> Iterator[None]:
    """Leaves ``model``'s parameters' gradients, and those of ``others``, as they were after a fake pass over its
    copy. A module the copy cannot clone is shared with it: a ``torch.jit.script``-ed one holds its parameters in its
    compiled module, which the copy's attributes point at, so the traced backward would write fake gradients into the
    user's parameters. ``others``: modules the loss runs on real weights (a discriminator a generator's step scores
    its output with), which the traced backward reaches as well."""
    saved = [(p, p.grad) for m in (model, *others) for p in m.parameters()]
    try:
        yield
    finally:
        for p, grad in saved:
            if p.grad is not grad:
                p.grad = grad


def _resolvable(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True


def truncate_stacks(model: nn.Module, keep: int = 3) -> list[tuple[BlockStack, int]]:
    """Shorten every stack of identical blocks to ``keep`` blocks in place; returns (stack, full length).

    A stack whose blocks after the first are not interchangeable, or a run among other layers, is left whole."""
    truncated: list[tuple[BlockStack, int]] = []
    for stack in find_block_stacks(model):
        full = len(stack)
        if full > keep and stack.uniform_tail and stack.start is None and stack.path:
            container = getattr(stack.parent, stack.attr)
            kept = list(stack.blocks[:keep])
            short: nn.Module
            if isinstance(container, nn.ModuleDict):
                short = nn.ModuleDict(dict(zip(list(container.keys())[:keep], kept)))
            elif isinstance(container, nn.Sequential):
                short = type(container)(*kept)
            else:
                short = nn.ModuleList(kept)
            setattr(stack.parent, stack.attr, short)
        truncated.append((stack, full))
    return truncated
