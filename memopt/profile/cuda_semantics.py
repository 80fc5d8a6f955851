"""CUDA memory semantics for CPU fake tensors: how memopt traces a GPU step on a machine without one.

Why: fake *CPU* tensors follow CPU dispatch, which saves different tensors than CUDA in a few places
that matter a lot (measured on an H200: +122% on GPT-2-medium, +132% on BERT-large). Fake *CUDA*
tensors need a CUDA device for autograd. memopt takes a third path, a dispatch layer active only
while a trace runs, that maps the CPU ops that differ to what their CUDA kernels allocate:

1. autocast: CUDA's op policy instead of CPU's (``autocast_policy``);
2. dropout: CUDA's fused ``native_dropout`` (1-byte mask) instead of CPU's mask in the input dtype;
3. ``scaled_dot_product_attention``: the CUDA backend selection and each fused kernel's outputs,
   saved tensors and scratch (``attention_kernels``);
4. cuBLAS: the workspace each thread's handle takes from the caching allocator on its first GEMM
   (the autograd engine runs backward on its own thread, hence its own workspace);
5. kernels whose CUDA implementation allocates temporaries the CPU one does not (softmax's backward
   computes ``grad * output`` into a full-size buffer first; ``_safe_softmax`` builds a mask);
6. recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``): cuDNN's one fused kernel with its reserve space, where
   the CPU unrolls every time step (``recurrent_kernels``).

Everything is undone on exit: no global state stays changed in the user's process, and
``torch.cuda.is_available()`` is never touched. A machine with a GPU traces the same way, so the plan
made next to the GPU is the one the dry run makes (``MEMOPT_TRACE_DEVICE=cuda`` traces fake CUDA tensors
instead, to compare: points 1-3 are then the GPU's own, while 4, 5 and the grouped GEMM's meta function are
facts of CUDA's kernels that neither path's dispatch sees, applied to both, ``cuda_kernel_facts``).

Which paths are exact is listed in the README ("How the trace sees a GPU").
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.library import Library

from memopt.categories import MemoryCategory
from memopt.hardware import HardwareSpec
from memopt.profile.attention_kernels import emulated_sdpa
from memopt.profile.attention_select import AttentionPolicy
from memopt.profile.autocast_policy import cuda_autocast_policy
from memopt.profile.hf_compat import grouped_mm_in_any_float
from memopt.profile.recurrent_kernels import recurrent_kernels
from memopt.profile.recurrent_kernels import scratch_bytes as recurrent_scratch
from memopt.profile.scalar_values import real_values
from memopt.profile.tracker import MemoryTracker
from memopt.units import MiB, allocator_size

__all__ = ["KernelPolicy", "cuda_kernel_facts", "cuda_semantics", "kernel_policy_for", "trace_semantics"]

_GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "addmv", "mv", "addr"}


@dataclass(frozen=True, kw_only=True)
class KernelPolicy:
    """Facts of the target GPU software stack that change memory (part of the profile's cache key)."""

    attention: AttentionPolicy = field(default_factory=AttentionPolicy)
    cublas_workspace_bytes: int = 32 * MiB
    backward_has_own_workspace: bool = True

    @property
    def cache_key(self) -> str:
        a = self.attention
        return (f"sm{a.sm}-cudnn{int(a.prefer_cudnn)}-ws{self.cublas_workspace_bytes}-"
                f"bw{int(self.backward_has_own_workspace)}-fq{a.flash_round_q}-fd{a.flash_round_d}")


def kernel_policy_for(hardware: HardwareSpec, **overrides: Any) -> KernelPolicy:
    """The kernel policy of ``hardware`` with the software stack memopt was calibrated on (torch 2.11)."""
    sm = hardware.sm
    extra = dict(hardware.extra.get("kernels", {}))
    extra.update(overrides)
    attention = AttentionPolicy(
        sm=sm,
        prefer_cudnn=bool(extra.pop("prefer_cudnn_attention", False)),
    )
    # cuBLAS: 32 MiB workspace per handle on Hopper, 4096 KiB * 2 + 16 KiB * 8 elsewhere (torch defaults)
    default_ws = 32 * MiB if sm >= 90 else 4096 * 1024 * 2 + 16 * 1024 * 8
    return KernelPolicy(
        attention=attention,
        cublas_workspace_bytes=int(extra.pop("cublas_workspace_bytes", default_ws)),
        backward_has_own_workspace=bool(extra.pop("backward_has_own_workspace", True)),
    )


class _Workspaces:
    """Counts each cuBLAS handle's workspace once, when that thread's first GEMM runs."""

    def __init__(self, tracker: MemoryTracker, policy: KernelPolicy) -> None:
        self.tracker = tracker
        self.policy = policy
        self.seen: set[str] = set()

    def __call__(self, func: Any, args: Any, out: Any) -> None:
        name = func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else ""
        if name not in _GEMM_OPS:
            return
        in_backward = torch._C._current_graph_task_id() >= 0
        handle = "backward" if in_backward and self.policy.backward_has_own_workspace else "forward"
        if threading.current_thread() is not threading.main_thread():
            handle = f"{handle}-{threading.get_ident()}"
        if handle not in self.seen:
            self.seen.add(handle)
            self.tracker.persistent(self.policy.cublas_workspace_bytes, f"cublas_workspace[{handle}]",
                                    MemoryCategory.TEMPORARIES)


class _KernelTemporaries:
    """Scratch that CUDA kernels allocate and free inside themselves, where the CPU kernels do not.

    * ``_softmax_backward_data`` (``softmax_backward_cuda_out``, ATen/native/cuda/SoftMax.cu):
      ``Tensor tmp = grad * output;`` before the reduction, a buffer as large as the gradient. It
      decides the peak of eager (math) attention's backward, where it is a second copy of the scores;
      measured on an H200 (torch 2.11): exactly the gradient's bytes.
    * ``_safe_softmax`` (math SDPA's softmax): ``self.eq(-inf)`` (a bool mask as large as the scores),
      ``all(masked, dim)`` over it and a scalar tensor live next to the output; measured on an H200 as
      mask + rows + 512 bytes.
    """

    def __init__(self, tracker: MemoryTracker) -> None:
        self.tracker = tracker

    def __call__(self, func: Any, args: Any, out: Any) -> None:
        if func is torch.ops.aten._softmax_backward_data.default:
            grad, output = args[0], args[1]
            dtype = torch.promote_types(grad.dtype, output.dtype)
            numel = torch.broadcast_shapes(grad.shape, output.shape).numel()
            self.tracker.transient(numel * dtype.itemsize, "softmax_backward.tmp")
        elif func is torch.ops.aten._safe_softmax.default:
            x = args[0]
            dim = args[1] if len(args) > 1 else -1
            numel = x.numel()
            if numel == 0:
                return
            rows = numel // x.shape[dim] if x.dim() > 0 else 1
            self.tracker.transient(allocator_size(numel) + allocator_size(rows) + allocator_size(1),
                                   "safe_softmax.mask")
        else:
            self.tracker.transient(recurrent_scratch(func, args), "cudnn_rnn.workspace")


def _pad_packed_kernel(data: torch.Tensor, batch_sizes: torch.Tensor, batch_first: bool, padding_value: float,
                      total_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pad_packed_sequence`` as ATen's composite runs it (a padded output, each step's rows copied in), with its
    ``lengths`` made as a real CPU tensor: ATen writes them through a data pointer a fake tensor does not have.
    ``batch_sizes`` holds real values in a trace (``memopt.profile.data_dependent``)."""
    with real_values():
        sizes = [int(b) for b in batch_sizes.tolist()]
        lengths = torch.tensor([sum(1 for b in sizes if b > i) for i in range(sizes[0] if sizes else 0)],
                               dtype=torch.long)
    steps = max(len(sizes), total_length)
    output = data.new_full((steps, sizes[0] if sizes else 0, *data.shape[1:]), padding_value)
    offset = 0
    for t, b in enumerate(sizes):
        output[t, :b] = data[offset:offset + b]
        offset += b
    return (output.transpose(0, 1) if batch_first else output), lengths


def _dropout_kernel(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    # CUDA: at::dropout takes the fused kernel for 0 < p < 1 (mask saved as bool)
    if train and 0.0 < p < 1.0 and x.numel() > 0:
        return torch.ops.aten.native_dropout.default(x, p, train)[0]
    if train and p == 1.0:
        return x * 0.0
    return x


@contextlib.contextmanager
def cuda_kernel_facts(policy: KernelPolicy, tracker: MemoryTracker | None = None) -> Iterator[None]:
    """What CUDA's kernels allocate that no dispatch mode sees, on *both* trace paths (fake CPU tensors emulating
    a GPU, and fake CUDA tensors on a GPU machine): the cuBLAS workspaces, the scratch of kernels that allocate
    inside themselves, and the output of the grouped GEMM in any float dtype (PyTorch's meta function for
    ``_grouped_mm`` admits only bf16 inputs, while its CUDA kernel also runs the fp32 inputs that transformers'
    MoE experts pass under autocast: ``_grouped_mm`` has no autocast kernel, so autocast never casts them)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(grouped_mm_in_any_float())
        if tracker is not None:
            for hook in (_Workspaces(tracker, policy), _KernelTemporaries(tracker)):
                tracker.op_hooks.append(hook)
                stack.callback(tracker.op_hooks.remove, hook)
        yield


def trace_semantics(policy: KernelPolicy, tracker: MemoryTracker | None, attention_log: list[str] | None, *,
                    emulate: bool) -> contextlib.AbstractContextManager[None]:
    """The context every trace runs in: the CUDA emulation on CPU fake tensors (``emulate``), else, on fake CUDA
    tensors, only the kernel facts both paths share (:func:`cuda_kernel_facts`)."""
    if emulate:
        return cuda_semantics(policy, tracker, attention_log)
    return cuda_kernel_facts(policy, tracker)


@contextlib.contextmanager
def cuda_semantics(policy: KernelPolicy, tracker: MemoryTracker | None = None,
                   attention_log: list[str] | None = None) -> Iterator[None]:
    """While active, CPU (fake) tensors allocate what the same code allocates on the GPU of ``policy``."""

    def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
                    enable_gqa: bool = False) -> torch.Tensor:
        return emulated_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa,
                             policy=policy.attention,
                             on_choice=attention_log.append if attention_log is not None else None)

    lib = Library("aten", "IMPL")
    with contextlib.ExitStack() as stack:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel" is what we mean
            stack.enter_context(cuda_autocast_policy())
            lib.impl("dropout", _dropout_kernel, "AutogradCPU")
            lib.impl("scaled_dot_product_attention", sdpa_kernel, "AutogradCPU")
            lib.impl("_pad_packed_sequence", _pad_packed_kernel, "AutogradCPU")
            stack.enter_context(recurrent_kernels(lib))
        stack.callback(lib._destroy)
        stack.enter_context(cuda_kernel_facts(policy, tracker))
        yield
