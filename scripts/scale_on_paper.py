"""Scale on paper: per-GPU model-state bytes of Llama-3-70B on 8 x 80 GB and Llama-3-405B on 64 x 80 GB.

Prints the tables of docs/sharding_at_scale.md: the ZeRO paper's Figure 1 reproduction, then for each model
and each sharding stage (with and without offload) the per-GPU model states, FSDP2 buffers, NCCL memory,
the activations kept by full checkpointing (block inputs only, analytic) and the host RAM per node.

    python scripts/scale_on_paper.py
"""

from __future__ import annotations

from memopt.distributed.engine_buffers import fsdp2_buffer_bytes, nccl_bytes
from memopt.distributed.memory import sharded_memory
from memopt.distributed.model_states import state_bytes, zero_paper_model_states

GB = 1e9

MODELS = {  # Llama 3 configs (hidden, intermediate, layers, heads, kv heads, vocab)
    "llama3_70b": (8192, 28672, 80, 64, 8, 128256),
    "llama3_405b": (16384, 53248, 126, 128, 8, 128256),
}


def counts(name: str) -> tuple[int, int, int]:
    d, inter, layers, heads, kv, vocab = MODELS[name]
    head_dim = d // heads
    block = d * d * 2 + 2 * d * kv * head_dim + 3 * d * inter + 2 * d
    root = 2 * vocab * d + d  # untied embedding and head, final norm
    return block, layers, root


def zero_paper() -> None:
    print("ZeRO paper, Figure 1: 7.5B parameters, 64 GPUs, K = 12")
    published = {"baseline": 120, "pos": 31.4, "pos+g": 16.6, "pos+g+p": 1.9}
    for key, value in zero_paper_model_states(7.5e9, 64).items():
        print(f"  {key:9s} {value / GB:7.2f} GB   (paper {published[key]} GB, {value / GB / published[key] - 1:+.1%})")


def table(name: str, world: int, *, batch: int = 1, seq: int = 4096, gpus_per_node: int = 8) -> None:
    block, layers, root = counts(name)
    d = MODELS[name][0]
    p = block * layers + root
    nodes = max(1, world // gpus_per_node)
    act = layers * batch * seq * d * 2  # full checkpointing keeps each block's bf16 input
    print(f"\n{name}: {p / 1e9:.1f}B parameters ({block / 1e6:.0f}M per block, root {root / 1e6:.0f}M), "
          f"{world} GPUs on {nodes} nodes; checkpointed block inputs {act / GB:.1f} GB (b={batch}, s={seq})")
    print(f"  {'setting':46s} {'params':>7s} {'grads':>7s} {'optim':>7s} {'buffers':>8s} {'total':>7s} "
          f"{'host/node':>10s}")
    rows = [
        ("DDP (bf16 weights + fp32 master, Adam)", "ddp", 0, "none", "none", "bf16_master"),
        ("DeepSpeed ZeRO-1 (bf16)", "deepspeed", 1, "none", "none", "bf16_autocast"),
        ("DeepSpeed ZeRO-2 (bf16)", "deepspeed", 2, "none", "none", "bf16_autocast"),
        ("DeepSpeed ZeRO-3 (bf16)", "deepspeed", 3, "none", "none", "bf16_autocast"),
        ("DeepSpeed ZeRO-3 + optimizer on CPU", "deepspeed", 3, "cpu", "none", "bf16_autocast"),
        ("DeepSpeed ZeRO-3 + optimizer and params on CPU", "deepspeed", 3, "cpu", "cpu", "bf16_autocast"),
        ("DeepSpeed ZeRO-Infinity (NVMe)", "deepspeed", 3, "nvme", "nvme", "bf16_autocast"),
        ("FSDP2 (fp32 shards, bf16 compute)", "fsdp2", 3, "none", "none", "bf16_autocast"),
        ("FSDP2 pure bf16 (bf16 Adam states)", "fsdp2", 3, "none", "none", "bf16_pure"),
        ("FSDP2 + CPUOffloadPolicy", "fsdp2", 3, "cpu", "cpu", "bf16_autocast"),
        ("FSDP2 pure bf16 + CPUOffloadPolicy", "fsdp2", 3, "cpu", "cpu", "bf16_pure"),
    ]
    for label, engine, stage, off_o, off_p, prec in rows:
        sb = state_bytes(engine, prec)
        m = sharded_memory(p, engine=engine, stage=stage, world_size=world, sb=sb, nodes=nodes,
                           unit_params=[block] * layers, root_params=root, largest_module_params=root // 2,
                           offload_optimizer=off_o, offload_params=off_p)
        total = m.params + m.grads + m.optimizer + m.buffers
        print(f"  {label:46s} {m.params / GB:7.1f} {m.grads / GB:7.1f} {m.optimizer / GB:7.1f} "
              f"{m.buffers / GB:8.1f} {total / GB:7.1f} {m.host_bytes / GB:9.0f}G"
              + (f" nvme {m.nvme_bytes / GB:.0f}G" if m.nvme_bytes else ""))
    print(f"  + NCCL {nccl_bytes(world) / GB:.2f} GB and the CUDA runtime (~0.8 GB) per GPU, outside the allocator")


def torchtune_70b() -> None:
    """torchtune's README: Llama 3.1 70B full fine-tune, 8 x A100, FSDP2 + CPU offload, pure bf16, AC, b=2, s=2048:
    13.9 GiB peak per GPU (tok_embeddings and output sharded as their own units)."""
    block, layers, root = counts("llama3_70b")
    sb = state_bytes("fsdp2", "bf16_pure")
    half = (root - MODELS["llama3_70b"][0]) // 2
    units = [half] + [block] * layers + [half]  # embedding and head as units of their own
    buf = fsdp2_buffer_bytes(units, shard_size=8, sb=sb, prefetch=1, root_params=MODELS["llama3_70b"][0])
    act = layers * 2 * 2048 * 8192 * 2
    print("\ntorchtune's 70B full fine-tune (8 x A100, FSDP2 + CPUOffloadPolicy, bf16, full AC, b=2, s=2048):")
    print(f"  gathered blocks + gradients + reduce buffers {buf['peak'] / 2**30:.1f} GiB, checkpointed inputs "
          f"{act / 2**30:.1f} GiB -> {(buf['peak'] + act) / 2**30:.1f} GiB before the recomputed block's "
          "activations and the chunked loss (published: 13.9 GiB)")


if __name__ == "__main__":
    zero_paper()
    table("llama3_70b", 8)
    table("llama3_405b", 64)
    torchtune_70b()
