"""Bytes per parameter of the model states each engine keeps, and each GPU's share of them at a ZeRO stage.

Every function here takes plain numbers (parameter counts, bytes per element, world sizes) and returns bytes; they
are the base that the engines' buffers (``memopt.distributed.engine_buffers``), one setting's whole picture
(``memopt.distributed.memory``) and the sharded estimate are built on, kept on their own because every one of
those needs them and they need nothing else.

Notation (the ZeRO paper's): ``P`` parameters, ``N`` ranks that a state is sharded over.

What each engine keeps, per parameter (``StateBytes``; see ``state_bytes``):

=================== =================================== ==================================================
engine / precision  persistent (sharded per stage)      transient (buffers)
=================== =================================== ==================================================
fsdp2 + mixed       params fp32 4, grads fp32 4,        one unit's params unsharded in bf16 (x2 while the
(MixedPrecision-    Adam fp32 8: 16 B in all, all /N    next unit is prefetched), its unsharded bf16 grads
Policy bf16/fp32)                                       and fp32 reduce-scatter input in backward
fsdp2 + bf16_pure   params 2, grads 2, Adam bf16 4      as above, reduce in bf16
deepspeed mixed     bf16 params 2, bf16 grads 2,        reduce / all-gather buckets (x4.5 with overlap_comm,
(bf16 or fp16)      fp32 master 4 + Adam 8              DeepSpeed's docs), the fp32 grad partition at step
ddp                 everything replicated               DDP's gradient buckets (views with
                                                        gradient_as_bucket_view=True: no extra bytes)
=================== =================================== ==================================================

ZeRO stages over ``N`` ranks: stage 1 shards the master weights and optimizer states, stage 2 the
gradients too, stage 3 the parameters too. FSDP2 is stage 3; hybrid sharding (HSDP, DeepSpeed MiCS)
shards over ``world / replicate_size`` ranks and replicates across the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from memopt.techniques.optimizers import VARIANTS

__all__ = [
    "StateBytes",
    "dtype_bytes",
    "model_state_bytes",
    "shard_numel",
    "state_bytes",
    "zero_paper_model_states",
]

_DTYPES = {"fp32": 4, "float32": 4, "tf32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1,
           "int8": 1, "uint8": 1}


def dtype_bytes(dtype: str | int) -> int:
    """Bytes of one element: ``dtype_bytes("bf16") == 2``; an int passes through."""
    if isinstance(dtype, int):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state an engine keeps.

    ``param``: the stored weights (what is sharded at stage 3); ``compute``: the dtype parameters are
    gathered / computed in; ``grad``: the stored gradient; ``master``: an fp32 master copy (0 when the
    stored weights are already the optimizer's); ``optim``: optimizer states; ``reduce``: the dtype
    gradients are reduced in; ``step_grad``: a full-precision copy of the gradient partition made for the
    optimizer step (DeepSpeed ZeRO-1/2 without offload).
    """

    param: int = 4
    compute: int = 4
    grad: int = 4
    master: int = 0
    optim: int = 8
    reduce: int = 4
    step_grad: int = 0

    @property
    def optimizer_side(self) -> int:
        """Master weights + optimizer states: the ZeRO paper's ``K``."""
        return self.master + self.optim


# the engines' own Adam, and the user's optimizer, are taken as AdamW: two states per parameter
_ADAM_STATES = 2


def state_bytes(engine: str, precision: str = "bf16_autocast", optimizer: str = "adamw_fused") -> StateBytes:
    """What ``engine`` keeps per parameter for a memopt precision and optimizer.

    FSDP2 maps memopt's mixed-precision settings (``bf16_autocast``, ``bf16_master``, ``fp16_autocast``)
    onto ``MixedPrecisionPolicy(param_dtype=bf16/fp16, reduce_dtype=fp32)``: the sharded parameters are
    the fp32 masters, so there is no separate master copy. DeepSpeed's bf16/fp16 modes keep 16-bit
    weights and gradients and an fp32 master partition. ``bf16_pure`` keeps everything in bf16
    (DeepSpeed has no such mode: it is mapped to its bf16 mode). 8-bit optimizers are not sharded by
    either engine here and raise.
    """
    known = VARIANTS.get(optimizer)
    if known is not None and known.sharded_states is None:
        raise ValueError(f"optimizer {optimizer!r} ({known.summary}) is not supported with sharding; use adamw_fused "
                         "(FSDP2 shards torch optimizers) or DeepSpeed's own Adam")
    factor = known.sharded_states if known is not None else _ADAM_STATES
    half = 2
    if engine in ("fsdp2", "ddp"):
        if precision == "fp32":
            return StateBytes(param=4, compute=4, grad=4, master=0, optim=4 * factor, reduce=4)
        if precision == "bf16_pure":
            return StateBytes(param=2, compute=2, grad=2, master=0, optim=2 * factor, reduce=2)
        if engine == "ddp":
            if precision == "bf16_master":
                return StateBytes(param=2, compute=2, grad=2, master=4, optim=4 * factor, reduce=2)
            return StateBytes(param=4, compute=4, grad=4, master=0, optim=4 * factor, reduce=4)
        return StateBytes(param=4, compute=half, grad=4, master=0, optim=4 * factor, reduce=4)
    if engine == "deepspeed":
        if precision == "fp32":
            return StateBytes(param=4, compute=4, grad=4, master=0, optim=4 * factor, reduce=4, step_grad=0)
        return StateBytes(param=2, compute=2, grad=2, master=4, optim=4 * factor, reduce=2, step_grad=4)
    raise ValueError(f"unknown engine {engine!r}; one of 'ddp', 'fsdp2', 'deepspeed'")


def shard_numel(numel: int, shape0: int | None, n: int) -> int:
    """Elements one rank stores of a tensor of ``numel`` elements sharded over ``n`` ranks.

    FSDP2 shards dim 0 and pads every rank's shard to ``ceil(dim0 / n)`` rows; pass the tensor's dim-0
    size as ``shape0`` for that. Without ``shape0`` the flat ``ceil(numel / n)`` is returned (DeepSpeed
    pads its flat partitions the same way up to alignment).
    """
    if n <= 1:
        return numel
    if shape0 is None or shape0 <= 0:
        return -(-numel // n)
    rows = -(-shape0 // n)
    return rows * (numel // shape0)


# -- model states -------------------------------------------------------------------------------------
def model_state_bytes(num_params: int, *, stage: int, shard_size: int, sb: StateBytes) -> dict[str, int]:
    """Persistent per-GPU bytes of params, gradients and optimizer side (master + states) at a ZeRO stage.

    Stage 0 replicates everything; stage 1 shards master + optimizer states over ``shard_size`` ranks;
    stage 2 also the gradients; stage 3 also the parameters. Flat ``ceil`` sharding (no per-tensor padding).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    n = max(1, shard_size)
    shard = -(-num_params // n)
    params = num_params * sb.param if stage < 3 else shard * sb.param
    grads = num_params * sb.grad if stage < 2 else shard * sb.grad
    optim = (num_params if stage == 0 else shard) * sb.optimizer_side
    return {"params": params, "grads": grads, "optimizer": optim}


def zero_paper_model_states(num_params: float, world_size: int, k: int = 12) -> dict[str, float]:
    """The ZeRO paper's Figure 1 figures (mixed-precision Adam: 2 + 2 + K bytes per parameter).

    Returns bytes per GPU for "baseline", "pos", "pos+g" and "pos+g+p" (Rajbhandari et al., 2020, sec. 5:
    7.5B parameters on 64 GPUs give 120, 31.4, 16.6 and 1.9 GB).
    """
    n, psi = world_size, float(num_params)
    return {"baseline": (2 + 2 + k) * psi, "pos": 2 * psi + 2 * psi + k * psi / n,
            "pos+g": 2 * psi + (2 + k) * psi / n, "pos+g+p": (2 + 2 + k) * psi / n}
