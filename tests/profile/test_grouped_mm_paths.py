"""The grouped GEMM of transformers' MoE experts under bf16 autocast with fp32 weights, on both trace paths.

On the GPU ``_grouped_mm`` is not autocast (no AutocastCUDA kernel): transformers casts its input to the weight
dtype and the CUDA kernel runs fp32. PyTorch's meta function admits only bf16, so a trace on fake CUDA tensors
crashed ("Expected inputs of BF16 type") where the CPU-emulated trace, which replaced the meta function, did not.
Both paths now enter the same kernel facts (``trace_semantics``)."""

import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memopt.profile.autocast_policy import CUDA_POLICY
from memopt.profile.cuda_semantics import KernelPolicy, trace_semantics
from memopt.profile.tracker import MemoryTracker

_BANNED_ON_CUDA = {"aten::binary_cross_entropy"}  # autocast raises for it: no policy to emulate


def _autocast_cuda_ops() -> set[str]:
    names = torch._C._dispatch_get_all_op_names()
    return {n for n in names if n.startswith("aten::")
            and torch._C._dispatch_has_kernel_for_dispatch_key(n, "AutocastCUDA")}


def test_grouped_mm_is_not_autocast_on_cuda_and_the_emulated_policy_agrees():
    cuda_ops = _autocast_cuda_ops()
    assert "aten::_grouped_mm" not in cuda_ops
    assert "_grouped_mm" not in CUDA_POLICY
    # and the emulation knows a policy for every op CUDA autocasts (so no op is left to CPU's policy)
    missing = {n for n in cuda_ops - _BANNED_ON_CUDA if n.removeprefix("aten::") not in CUDA_POLICY}
    assert not missing


def _grouped(device: str) -> torch.Tensor:
    tokens, hidden, out, experts = 12, 16, 24, 4
    a = torch.empty(tokens, hidden, device=device)  # fp32: what the experts pass with fp32 weights
    b = torch.empty(experts, hidden, out, device=device)
    offs = torch.tensor([3, 6, 9, 12], dtype=torch.int32, device=device)
    return torch._grouped_mm(a, b, offs=offs)


@pytest.mark.parametrize("emulate", [True, False], ids=["cpu_emulated", "fake_cuda"])
def test_fp32_grouped_mm_traces_on_both_paths(emulate):
    device = "cpu" if emulate else "cuda"
    tracker = MemoryTracker(device)
    semantics = trace_semantics(KernelPolicy(), tracker, [], emulate=emulate)
    with FakeTensorMode(allow_non_fake_inputs=True), semantics, tracker:
        out = _grouped(device)
    assert out.shape == (12, 24) and out.dtype == torch.float32 and out.device.type == device
    assert tracker.peak_bytes >= 12 * 24 * 4


def test_without_the_shared_kernel_facts_fake_cuda_crashes_as_reported():
    # in a fresh process: fake tensors keep what they learned about an op for the rest of the process
    code = ("import torch\nfrom torch._subclasses.fake_tensor import FakeTensorMode\n"
            "with FakeTensorMode():\n"
            "    a = torch.empty(12, 16, device='cuda'); b = torch.empty(4, 16, 24, device='cuda')\n"
            "    torch._grouped_mm(a, b, offs=torch.tensor([3, 6, 9, 12], dtype=torch.int32, device='cuda'))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "Expected inputs of BF16 type" in run.stderr


def test_kernel_facts_enter_where_torch_refuses_a_second_python_meta_kernel(monkeypatch):
    """torch 2.11 (the GPU machine's) raises when a Python kernel already overrides the key, as the grouped GEMM's
    meta function does: every trace on that machine failed before the facts stepped aside."""
    import torch.library

    from memopt.profile.cuda_semantics import cuda_kernel_facts

    original = torch.library.Library.impl

    def strict(self, op_name, fn, dispatch_key="", **kwargs):
        kwargs["allow_override"] = False
        return original(self, op_name, fn, dispatch_key, **kwargs)

    monkeypatch.setattr(torch.library.Library, "impl", strict)
    policy = KernelPolicy()
    before = "aten/_grouped_mm/Meta" in torch.library._impls
    with cuda_kernel_facts(policy):
        pass
    with cuda_kernel_facts(policy):  # and again: the bookkeeping is restored as it was
        pass
    assert ("aten/_grouped_mm/Meta" in torch.library._impls) == before
