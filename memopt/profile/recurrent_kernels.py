"""``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` as cuDNN's one fused kernel, reproduced on CPU (fake) tensors.

On a GPU a recurrent layer is one call of ``_cudnn_rnn``: it writes the output, the last hidden (and cell) state and
a *reserve space* that keeps every time step's gate activations for the backward, and its backward
(``_cudnn_rnn_backward``) writes the gradients of the input, the initial states and every weight. The CPU runs the
recurrence step by step instead: a trace of it records a few ops per layer and time step (63k events for a GRU of
3 layers over 512 steps, traced once per variant: minutes of planning) and counts each step as a kernel launch of
its own (a step-time prediction 12x too slow), and a CPU LSTM takes a oneDNN path whose meta function keeps no
workspace (the saved activations under-counted). Here each layer call is one custom op whose forward and backward
allocate what the cuDNN kernel allocates: output, states and reserve, the input copy and workspace it holds inside
itself, and the weight buffer that autocast re-flattens in the low-precision dtype.

How the sizes were fixed. cuDNN does not publish its reserve-space size (PyTorch's own meta function for
``_cudnn_rnn`` gives it 0 bytes, and the fake-CUDA trace inherits that). ``scripts/rnn_kernel_probe_gpu.py`` read it
from ``_cudnn_rnn``'s outputs for 86 configurations (mode, dtype, autocast, input and hidden size, layers,
directions, projection, batch, length, packing; cuDNN 9.19 on an H100, ``benchmarks/recurrent/``), and every one is
this, in the kernel's dtype, per row (one time step of one sequence) and direction:
:data:`RESERVE_VECTORS` hidden-size vectors per layer (LSTM 5: four gates and the cell; GRU 6: three gates on each
side, kept apart because the candidate gate multiplies the hidden side by the reset gate; plain RNN 1), an LSTM
projection's 5 projected-size vectors per layer, and the output of every layer but the last; plus 256 bytes.
All 86 agree to the byte.

The workspace (:func:`workspace_bytes`: one gate-width buffer per row forward, two backward) and the GPU time of a
recurrent time step (``TimingModel.recurrent_step_s``, one kernel launch's worth) are assumptions of the same kind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.library import Library

from memopt.units import allocator_size

__all__ = ["RESERVE_VECTORS", "RecurrentShape", "recurrent_cost", "recurrent_kernels", "reserve_bytes", "scratch_bytes",
           "workspace_bytes"]

# gates per cell: what one time step of one layer computes from the input and the previous hidden state
_GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
_MODE_IDS = {name: i for i, name in enumerate(_GATES)}
# hidden-size vectors per row, layer and direction in the reserve space (see the module's docstring)
RESERVE_VECTORS = {"lstm": 5, "gru": 6, "rnn_tanh": 1, "rnn_relu": 1}
_RESERVE_PAD = 256  # bytes cuDNN adds to every reserve space (all 86 probed configurations)


@dataclass(frozen=True)
class RecurrentShape:
    """One recurrent layer stack as cuDNN sees it."""

    mode: str
    input_size: int
    hidden_size: int
    proj_size: int
    num_layers: int
    directions: int
    steps: int  # sequence length (packed: the number of batch sizes)
    rows: int  # rows over all steps: batch x steps, or the packed rows
    batch: int  # the largest batch of a step
    itemsize: int

    @property
    def out_size(self) -> int:
        return self.proj_size or self.hidden_size


def reserve_bytes(s: RecurrentShape) -> int:
    """cuDNN's training reserve space: per layer, direction and row, the gate activations and the states the
    backward reads."""
    per_layer = RESERVE_VECTORS[s.mode] * s.hidden_size + 5 * s.proj_size
    per_row = s.num_layers * per_layer + (s.num_layers - 1) * s.out_size
    return s.directions * s.rows * per_row * s.itemsize + _RESERVE_PAD


def workspace_bytes(s: RecurrentShape, backward: bool) -> int:
    """cuDNN's temporary workspace of one call (allocated and freed inside it)."""
    gates = _GATES[s.mode] * s.hidden_size
    return s.directions * s.rows * gates * s.itemsize * (2 if backward else 1)


def recurrent_cost(func: Any, args: tuple) -> tuple[torch.dtype, float, int] | None:
    """(dtype, matmul FLOPs, serial kernels) of a call of the fused kernel, ``None`` for any other op: the
    backward computes the gradients of the input and of the weights, twice the forward's products."""
    if func is _FORWARD:
        s, backward = shape_of(args[4])[0], False
    elif func is _BACKWARD:
        s, backward = shape_of(args[6])[0], True
    else:
        return None
    return args[0].dtype, recurrent_flops(s) * (2 if backward else 1), serial_kernels(s, backward)


def recurrent_flops(s: RecurrentShape) -> float:
    """Matmul FLOPs of the forward: per layer and direction, the input and the recurrent products of every row."""
    g = _GATES[s.mode] * s.hidden_size
    total = 0.0
    for layer in range(s.num_layers):
        width_in = s.input_size if layer == 0 else s.out_size * s.directions
        per_row = 2.0 * g * (width_in + s.out_size) + (2.0 * s.hidden_size * s.proj_size if s.proj_size else 0.0)
        total += s.directions * s.rows * per_row
    return total


def serial_kernels(s: RecurrentShape, backward: bool) -> int:
    """Kernels cuDNN runs one after another: a recurrent step per time step, layer and direction (the backward
    also one weight-gradient pass per layer)."""
    return s.num_layers * s.directions * (s.steps * (2 if backward else 1) + (1 if backward else 0))


# --- the custom ops: what the CostRecorder and the tracker see ----------------------------------------------------
_lib = Library("memopt", "FRAGMENT")
_lib.define("cudnn_rnn(Tensor input, Tensor hx, Tensor? cx, Tensor[] weights, int[] shape) "
            "-> (Tensor, Tensor, Tensor, Tensor)")
_lib.define("cudnn_rnn_backward(Tensor input, Tensor hx, Tensor? cx, Tensor[] weights, Tensor output, "
            "Tensor reserve, int[] shape) -> (Tensor, Tensor, Tensor, Tensor[])")
_FORWARD = torch.ops.memopt.cudnn_rnn.default
_BACKWARD = torch.ops.memopt.cudnn_rnn_backward.default


def _shape_list(s: RecurrentShape, batch_first: bool, packed: bool) -> list[int]:
    return [_MODE_IDS[s.mode], s.input_size, s.hidden_size, s.proj_size, s.num_layers, s.directions, s.steps,
            s.rows, s.batch, s.itemsize, int(batch_first), int(packed)]


def shape_of(packed_shape: list[int]) -> tuple[RecurrentShape, bool, bool]:
    mode = next(n for n, i in _MODE_IDS.items() if i == packed_shape[0])
    s = RecurrentShape(mode, *packed_shape[1:10])
    return s, bool(packed_shape[10]), bool(packed_shape[11])


def _forward_impl(input: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor | None, weights: list[torch.Tensor],
                  shape: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    s, batch_first, packed = shape_of(shape)
    width = s.out_size * s.directions
    if packed:
        output = input.new_empty(s.rows, width)
    else:  # cuDNN writes time-major and hands back the transposed view for batch_first
        output = input.new_empty(s.steps, s.batch, width)
        output = output.transpose(0, 1) if batch_first else output
    hy = hx.new_empty(hx.shape)
    cy = cx.new_empty(cx.shape) if cx is not None else input.new_empty(0)
    reserve = input.new_empty(reserve_bytes(s), dtype=torch.uint8)
    return output, hy, cy, reserve


def _backward_impl(input: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor | None, weights: list[torch.Tensor],
                   output: torch.Tensor, reserve: torch.Tensor, shape: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    d_input = torch.empty_like(input, memory_format=torch.contiguous_format)
    d_hx = torch.empty_like(hx)
    d_cx = torch.empty_like(cx) if cx is not None else input.new_empty(0)
    # one flat buffer for every weight's gradient, handed out as views (``_cudnn_rnn_backward_weight``)
    flat = input.new_empty(sum(w.numel() for w in weights), dtype=weights[0].dtype if weights else input.dtype)
    d_weights, offset = [], 0
    for w in weights:
        d_weights.append(flat[offset:offset + w.numel()].view(w.shape))
        offset += w.numel()
    return d_input, d_hx, d_cx, d_weights


def scratch_bytes(func: Any, args: tuple) -> int:
    """What a call of the fused kernel holds inside itself beside its outputs (0 for any other op): the time-major
    copies of a batch-first input (and, backward, of the output and its gradient), and cuDNN's workspace. A tracker
    op hook adds it once the call's outputs are counted."""
    if func is _FORWARD:
        s, batch_first, packed = shape_of(args[4])
        copy = args[0].numel() * args[0].element_size() if batch_first and not packed else 0
        return allocator_size(copy) + allocator_size(workspace_bytes(s, backward=False))
    if func is _BACKWARD:
        s, batch_first, packed = shape_of(args[6])
        out = args[4]
        copies = 2 * out.numel() * out.element_size() if batch_first and not packed else 0
        return allocator_size(copies) + allocator_size(workspace_bytes(s, backward=True))
    return 0


# CPU for tensors of the emulated trace's CPU stand-in; the fake registration is also the Meta kernel (torch
# refuses a fake registration beside a Meta one of our own)
_lib.impl("cudnn_rnn", _forward_impl, "CPU")
_lib.impl("cudnn_rnn_backward", _backward_impl, "CPU")
torch.library.register_fake("memopt::cudnn_rnn", _forward_impl, lib=_lib)
torch.library.register_fake("memopt::cudnn_rnn_backward", _backward_impl, lib=_lib)


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    input, hx, cx, weights, shape = inputs
    out, _hy, _cy, reserve = output
    ctx.mark_non_differentiable(reserve)
    ctx.set_materialize_grads(False)
    ctx.has_cx = cx is not None
    ctx.num_weights = len(weights)
    ctx.shape = shape
    ctx.save_for_backward(input, hx, *([cx] if cx is not None else []), out, reserve, *weights)


def _backward(ctx: Any, g_out: Any, g_hy: Any, g_cy: Any, g_reserve: Any) -> tuple:
    saved = list(ctx.saved_tensors)
    input, hx = saved[0], saved[1]
    cx = saved[2] if ctx.has_cx else None
    rest = saved[3 if ctx.has_cx else 2:]
    out, reserve, weights = rest[0], rest[1], rest[2:]
    d_input, d_hx, d_cx, d_weights = _BACKWARD(input, hx, cx, weights, out, reserve, ctx.shape)
    return d_input, d_hx, (d_cx if ctx.has_cx else None), list(d_weights), None


torch.library.register_autograd("memopt::cudnn_rnn", _backward, setup_context=_setup, lib=_lib)


# --- the ATen entry points that nn.LSTM / nn.GRU / nn.RNN call ---------------------------------------------------
def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ == "FakeTensor"


def _fused(mode: str, input: torch.Tensor, batch_sizes: torch.Tensor | None, hx: torch.Tensor, cx: torch.Tensor | None,
           params: list[torch.Tensor], has_biases: bool, num_layers: int, bidirectional: bool, batch_first: bool
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    directions = 2 if bidirectional else 1
    hidden = cx.shape[-1] if cx is not None else hx.shape[-1]
    proj = hx.shape[-1] if cx is not None and hx.shape[-1] != hidden else 0
    dtype = input.dtype
    if torch.is_autocast_enabled("cpu"):  # the CUDA autocast wrapper of _cudnn_rnn: inputs and weights in its dtype
        dtype = torch.get_autocast_dtype("cpu")
        input, hx = input.to(dtype), hx.to(dtype)
        cx = cx.to(dtype) if cx is not None else None
        params = [p.to(dtype) for p in params]  # re-flattened into one low-precision buffer, kept for the backward
    if batch_sizes is not None:  # shapes alone: a step per batch size, the states sized for the largest batch
        steps, rows, batch = batch_sizes.shape[0], input.shape[0], hx.shape[1]
    else:
        steps = input.shape[1] if batch_first else input.shape[0]
        batch = input.shape[0] if batch_first else input.shape[1]
        rows = steps * batch
    s = RecurrentShape(mode, input.shape[-1], hidden, proj, num_layers, directions, steps, rows, batch,
                       torch.empty((), dtype=dtype).element_size())
    out, hy, cy, _ = _FORWARD(input, hx, cx, params, _shape_list(s, batch_first, batch_sizes is not None))
    return out, hy, (cy if cx is not None else None)


def _aten_kernel(mode: str, aten_op: Any, two_states: bool, packed: bool) -> Any:
    """The ``aten::<mode>.input`` kernel (``packed`` False: input, hx, params, ..., batch_first) or ``.data`` kernel
    (``packed``: data, batch_sizes, hx, params, ...; time-major)."""
    def kernel(*args: Any) -> Any:
        data, batch_sizes = args[0], (args[1] if packed else None)
        hx, params, has_biases, num_layers, _dropout, train, bidirectional = args[1 + packed:8 + packed]
        if not _is_fake(data) or not train:
            return aten_op.decompose(*args)
        h, c = (hx[0], hx[1]) if two_states else (hx, None)
        out, hy, cy = _fused(mode, data, batch_sizes, h, c, list(params), has_biases, num_layers, bidirectional,
                             False if packed else args[8])
        return (out, hy, cy) if two_states else (out, hy)
    return kernel


@contextlib.contextmanager
def recurrent_kernels(lib: Library) -> Iterator[None]:
    """Route fake tensors' recurrent layers through the fused kernel while ``lib`` (an ``aten`` IMPL library
    that the caller destroys on exit) is alive; real tensors and evaluation keep ATen's own path."""
    for name in _GATES:
        packet = getattr(torch.ops.aten, name)
        two = name == "lstm"
        lib.impl(f"{name}.input", _aten_kernel(name, packet.input, two, packed=False), "AutogradCPU")
        lib.impl(f"{name}.data", _aten_kernel(name, packet.data, two, packed=True), "AutogradCPU")
    yield
