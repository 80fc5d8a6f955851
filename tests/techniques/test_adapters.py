"""LoRA / DoRA adapters (peft): targets, gradients against a hand-written forward, only adapters train, saved
adapters load into the unquantized model, the undo, and the estimator's counts against hand-computed truths."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("peft")

from memopt.models import SampleSpec, build_model, load_model_spec, make_batch
from memopt.strategy import Strategy
from memopt.techniques.adapter_bytes import adapter_memory, adapter_param_count, optimizer_state_bytes
from memopt.techniques.adapters import (
    AdapterSetting,
    adapter_state_dict,
    apply_adapters,
    find_target_linears,
    load_adapter_state_dict,
    target_shapes,
)

pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")
SPEC = load_model_spec("tiny_llama")


class _Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList([_Block(16, 32) for _ in range(2)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.layers:
            h = block(h)
        return self.head(h)


def _toy_reference(toy: _Toy, x: torch.Tensor, adapters: dict[str, dict[str, torch.Tensor]], scaling: float,
                   dora: bool = False) -> torch.Tensor:
    """The toy's forward with LoRA (or DoRA) written out by hand from the frozen weights and the adapter tensors."""

    def linear(name: str, base: nn.Linear, v: torch.Tensor) -> torch.Tensor:
        a, b = adapters[name]["A"], adapters[name]["B"]
        w = base.weight.detach()
        out = F.linear(v, w) + scaling * F.linear(F.linear(v, a), b)
        if dora:  # y = m / ||W + s B A||_row (detached) * (x W^T + s x A^T B^T) + bias
            norm = (w + scaling * b @ a).norm(dim=1).detach()
            out = adapters[name]["m"] / norm * out
        return out + (base.bias.detach() if base.bias is not None else 0)

    h = toy.embed(x)
    for i, block in enumerate(toy.layers):
        up = linear(f"layers.{i}.up", block.up.base_layer, h)
        h = h + linear(f"layers.{i}.down", block.down.base_layer, torch.tanh(up))
    return toy.head(h)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_gradients_match_a_hand_written_forward(kind):
    torch.manual_seed(0)
    toy = _Toy()
    assert find_target_linears(toy) == ["layers.0.up", "layers.0.down", "layers.1.up", "layers.1.down"]
    setting = AdapterSetting(kind=kind, r=4, alpha=8)
    _, undo = apply_adapters(toy, setting)
    refs: dict[str, dict[str, torch.Tensor]] = {}
    for name in ["layers.0.up", "layers.0.down", "layers.1.up", "layers.1.down"]:
        layer = toy.get_submodule(name)
        with torch.no_grad():
            layer.lora_B["default"].weight.normal_()  # peft starts B at zero: no gradient would reach A
            if kind == "dora":
                layer.lora_magnitude_vector["default"].weight.uniform_(0.5, 1.5)
        refs[name] = {"A": layer.lora_A["default"].weight.detach().clone().requires_grad_(),
                      "B": layer.lora_B["default"].weight.detach().clone().requires_grad_()}
        if kind == "dora":
            refs[name]["m"] = layer.lora_magnitude_vector["default"].weight.detach().clone().requires_grad_()
    x = torch.randn(5, 8)
    out = toy(x)
    out.pow(2).mean().backward()
    ref = _toy_reference(toy, x, refs, setting.scaling, dora=kind == "dora")
    ref.pow(2).mean().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for name, r in refs.items():
        layer = toy.get_submodule(name)
        torch.testing.assert_close(layer.lora_A["default"].weight.grad, r["A"].grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(layer.lora_B["default"].weight.grad, r["B"].grad, rtol=1e-4, atol=1e-6)
        if kind == "dora":
            torch.testing.assert_close(layer.lora_magnitude_vector["default"].weight.grad, r["m"].grad,
                                       rtol=1e-4, atol=1e-6)
        assert layer.base_layer.weight.grad is None  # frozen
    undo()


def test_targets_counts_and_undo_on_tiny_llama():
    torch.manual_seed(0)
    model = build_model("tiny_llama", device="cpu")
    names = find_target_linears(model)
    assert len(names) == 14 and "lm_head" not in " ".join(names) and "embed" not in " ".join(names)
    assert names[:3] == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                         "model.layers.0.self_attn.v_proj"]
    shapes = target_shapes(model)
    originals = {n: model.get_submodule(n) for n in names}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attrs = set(vars(model))
    setting = AdapterSetting(kind="dora", r=8)
    peft_model, undo = apply_adapters(model, setting)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in trainable)
    assert sum(p.numel() for p in trainable.values()) == adapter_param_count(shapes, setting)
    assert all(p.dtype == torch.float32 for p in trainable.values())
    assert peft_model.base_model.model is model
    undo()
    assert all(model.get_submodule(n) is originals[n] for n in names)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert set(vars(model)) == attrs


def _train(model: nn.Module, strategy: Strategy, batch: dict, steps: int):
    from memopt.step.prepare import prepare

    prepared = prepare(model, strategy, device_type="cpu", optimizer_kwargs={"lr": 1e-2})
    for _ in range(steps):
        prepared.step.step(batch)
    return prepared


def test_only_adapters_train_and_the_saved_adapter_loads_into_the_unquantized_model():
    pytest.importorskip("bitsandbytes")
    from memopt.profile.quant_stand_ins import quant_state_tensors
    from memopt.techniques.quantization import qlora

    torch.manual_seed(0)
    model = build_model("tiny_llama", device="cpu")
    pristine = copy.deepcopy(model)
    batch = make_batch(SPEC, SampleSpec.parse({"batch_size": 2, "seq_len": 32}, SPEC), device="cpu")
    strategy = qlora(Strategy(), r=8)  # 4-bit NF4 base, LoRA, paged 8-bit AdamW
    prepared = _train(model, strategy, batch, steps=0)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    states = [t.clone() for t in quant_state_tensors(model)]
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    losses = [prepared.step.step(batch) for _ in range(3)]
    assert losses[-1] < losses[0]
    for n, p in model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p.detach(), frozen[n]), n  # bitwise unchanged (packed 4-bit codes included)
    assert all(torch.equal(a, b) for a, b in zip(states, quant_state_tensors(model)))
    saved = adapter_state_dict(model)
    assert len(saved) == 2 * 14 and all(k.endswith((".lora_A.default.weight", ".lora_B.default.weight"))
                                         for k in saved)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # the adapters learned
    model.eval()
    with torch.no_grad():
        quantized = model(input_ids=batch["input_ids"]).logits
    prepared.undo()
    with torch.no_grad():
        base = pristine.eval()(input_ids=batch["input_ids"]).logits
    _, undo = apply_adapters(pristine, strategy.extra("adapters"))
    load_adapter_state_dict(pristine, saved)
    with torch.no_grad():
        full = pristine(input_ids=batch["input_ids"]).logits
    undo()
    rel = float((quantized - full).norm() / full.norm())
    assert rel < 0.1  # the NF4 error (measured 0.091 without adapters)
    assert not torch.equal(full, base)
    with pytest.raises(ValueError, match="do not match"):
        load_adapter_state_dict(pristine, saved)  # no adapters on it any more


def test_apply_qlora_outside_a_strategy():
    bnb = pytest.importorskip("bitsandbytes")
    from memopt.techniques.quantization_apply import apply_qlora

    model = build_model("tiny_llama", device="cpu")
    q_proj = model.model.layers[0].self_attn.q_proj
    names = find_target_linears(model)
    peft_model, opt, undo = apply_qlora(model, adapters=AdapterSetting(r=4))
    assert isinstance(opt, bnb.optim.PagedAdamW8bit)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == \
        {id(p) for n, p in model.named_parameters() if "lora_" in n}
    assert type(model.model.layers[0].self_attn.q_proj.base_layer).__name__ == "Linear4bit"
    assert peft_model.peft_config["default"].target_modules == set(names)  # the list found automatically
    undo()
    assert model.model.layers[0].self_attn.q_proj is q_proj and not hasattr(model, "is_loaded_in_4bit")


def test_lora_over_8bit_trains_on_cpu():
    pytest.importorskip("bitsandbytes")
    from memopt.techniques.quantization import qlora

    torch.manual_seed(0)
    model = build_model("tiny_llama", device="cpu")
    batch = make_batch(SPEC, SampleSpec.parse({"batch_size": 2, "seq_len": 16}, SPEC), device="cpu")
    prepared = _train(model, qlora(Strategy(), r=4, bits=8, optimizer="adamw"), batch, steps=2)
    assert type(model.model.layers[0].self_attn.q_proj.base_layer).__name__ == "Linear8bitLt"
    prepared.undo()
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear


# ---------------------------------------------------------------------------------------------------------------
# estimator pieces
# ---------------------------------------------------------------------------------------------------------------

def test_adapter_counts_and_bytes_hand_computed():
    # Llama-3-8B attention + MLP projections of one block, rank 16
    block = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
    lora = AdapterSetting(r=16)
    per_block = 16 * (2 * (4096 + 4096) + 2 * (1024 + 4096) + 3 * (14336 + 4096))
    assert adapter_param_count(block, lora) == per_block == 1_310_720
    assert adapter_param_count(block, AdapterSetting(kind="dora", r=16)) == per_block + 3 * 4096 + 2 * 1024 + 2 * 14336
    m = adapter_memory(block, lora, optimizer="adamw_fused", rounded=False)
    assert m.params == m.grads == 4 * per_block and m.optimizer_paged == 0 and m.count == per_block
    assert m.optimizer_device == 8 * per_block + 14 * 4  # two fp32 moments + a 4-byte step per tensor (fused)
    # paged 8-bit AdamW: a tensor's two 1-byte states are paged when it has >= 100,000 values (here B of gate and
    # up, A of down: 16 x 14336 = 229,376); the fp32 absmax per 256 values and the two qmaps stay on the device
    numels = [65536, 65536, 65536, 16384, 65536, 16384, 65536, 65536, 65536, 229376, 65536, 229376, 229376, 65536]
    assert sum(numels) == per_block
    p = adapter_memory(block, lora, optimizer="paged_adamw8bit", rounded=False)
    assert p.optimizer_paged == 2 * 3 * 229376
    blocks = sum(n // 256 for n in numels)
    assert p.optimizer_device == 2 * (per_block - 3 * 229376) + 2 * 4 * blocks + 2 * 1024
    assert adapter_memory(block, lora, optimizer="adamw8bit", rounded=False).optimizer_device == \
        2 * per_block + 2 * 4 * blocks + 2 * 1024
    # bitsandbytes keeps fp32 states below 4096 values
    assert optimizer_state_bytes([4095], "adamw8bit", rounded=False) == (2 * 4 * 4095, 0)
    assert optimizer_state_bytes([4096], "adamw8bit", rounded=False) == (2 * 4096 + 2 * 4 * 16 + 2 * 1024, 0)
    assert optimizer_state_bytes([100], "sgd") == (512, 0)


def test_optimizer_state_bytes_match_bitsandbytes():
    bnb = pytest.importorskip("bitsandbytes")
    params = [nn.Parameter(torch.randn(16, 512)), nn.Parameter(torch.randn(8, 64))]  # 8192 (8-bit) and 512 values
    opt = bnb.optim.AdamW8bit(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    seen, total = set(), 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and id(v.untyped_storage()) not in seen:
                seen.add(id(v.untyped_storage()))
                total += v.untyped_storage().nbytes()
    assert optimizer_state_bytes([8192, 512], "adamw8bit", rounded=False) == (total, 0)
