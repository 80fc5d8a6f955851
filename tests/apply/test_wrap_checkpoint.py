"""memopt.wrap(spec, checkpoint=...): plan first, then load the weights under the plan (quantized as they load for
QLoRA), train; the load's peak against ``load_peak_bytes``, measured by the CPU tracker."""

import pytest
import torch

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

import memopt
from memopt.models import SampleSpec, build_model, make_batch
from memopt.profile.tracker import MemoryTracker
from memopt.techniques.quantization import QuantSetting
from memopt.techniques.quantization_apply import is_quantized
from memopt.techniques.quantized_load import load_peak_bytes, load_quantized, model_skeleton
from memopt.units import allocator_size

pytestmark = pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")
SAMPLE = {"batch_size": 4, "seq_len": 32}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = build_model("tiny_llama", device="cpu")
    path = tmp_path_factory.mktemp("ckpt") / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path, model


def _batch(seed: int) -> dict:
    return make_batch("tiny_llama", SampleSpec.parse(SAMPLE, "tiny_llama"),
                      generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("setting", [QuantSetting(), QuantSetting(bits=8), QuantSetting(double_quant=False), None],
                         ids=["nf4+dq", "int8", "nf4", "unquantized"])
def test_load_peak_matches_the_tracked_load(checkpoint, setting):
    path, model = checkpoint
    skeleton = model_skeleton("tiny_llama")
    predicted = load_peak_bytes(skeleton, setting, dtype=torch.float32, checkpoint_dtype=torch.float32)
    tracker = MemoryTracker("cpu")
    with tracker:
        load_quantized(skeleton, path, setting or QuantSetting(), "cpu", targets=None if setting else [])
    # on a CPU the tensor read from the file is host memory too: the tracker also sees the largest one read while
    # its copy is made (on a GPU the read stays in host memory, outside the device's allocator)
    largest_read = max(allocator_size(p.numel() * 4) for p in model.parameters())
    assert tracker.current_bytes <= predicted  # what stays: at most the predicted peak
    assert abs(tracker.peak_bytes - (predicted + largest_read)) <= 0.01 * tracker.peak_bytes


@pytest.mark.parametrize("precision, micro", [("bf16_autocast", None), ("bf16_master", None), ("bf16_master", 2)])
def test_wrap_plans_then_loads_the_checkpoint_quantized_and_trains(checkpoint, precision, micro):
    """Micro-batched too: the first split step measures the loss (label shift, reduction) in eval mode, where
    bitsandbytes' CPU path would repack the frozen 4-bit weights in place."""
    path, model = checkpoint
    pins = {"quant_bits": 4, "precision": precision, **({"micro_batch_size": micro} if micro else {})}
    w = memopt.wrap("tiny_llama", checkpoint=path, budget="2GB", sample=SAMPLE, hardware="h200", fidelity="qlora",
                    pins=pins, lr=1e-2, autotune=False)
    strategy = w.plan.strategy
    assert strategy.extra("quantization") is not None and strategy.extra("adapters") is not None
    assert any(n.startswith("Training method changed") for n in w.plan.notes)
    assert is_quantized(w.model) and not any(p.device.type == "meta" for p in w.model.parameters())
    trainable = [n for n, p in w.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in w.model.named_parameters() if not p.requires_grad}
    losses = [w.step(_batch(0)) for _ in range(6)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]  # the adapters learn the repeated batch
    assert all(torch.equal(p, frozen[n]) for n, p in w.model.named_parameters() if n in frozen)  # base frozen
    # the loaded weights are the checkpoint's: the embedding matches the model that wrote it
    emb = model.get_input_embeddings().weight
    assert torch.equal(w.model.get_input_embeddings().weight.float(), emb.to(w.model.dtype).float())
    if precision == "bf16_master":  # fp32 masters of exactly the adapters (not of the frozen base)
        masters = w._prepared.step.master.masters
        assert len(masters) == len(trainable) and all(m.dtype == torch.float32 for m in masters)


def test_wrap_with_a_checkpoint_and_full_fine_tuning_loads_in_the_plan_dtype(checkpoint):
    path, model = checkpoint
    w = memopt.wrap("tiny_llama", checkpoint=path, budget="4GB", sample=SAMPLE, hardware="h200",
                    pins={"precision": "fp32"}, lr=1e-3, autotune=False)
    assert not w.plan.strategy.extras and not is_quantized(w.model)
    ref = model.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in w.model.state_dict().items())
    assert torch.isfinite(torch.tensor(w.step(_batch(1))))


def test_a_meta_model_without_checkpoint_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="checkpoint="):
        memopt.wrap(model_skeleton("tiny_llama"), budget="4GB", sample=SAMPLE, hardware="h200")


def test_a_tied_lm_head_stays_one_tensor_through_the_skeleton_and_the_load(tmp_path):
    # init_empty_weights unties tied parameters; a second LM head copy (+544 MB on Qwen2.5-0.5B) was measured on
    # the H200 before the skeleton re-tied them
    from safetensors.torch import save_file

    from memopt.models import with_overrides

    spec = with_overrides("qwen25_0_5b", {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                          "num_attention_heads": 4, "num_key_value_heads": 2})
    model = build_model(spec, device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    path = tmp_path / "tied.safetensors"
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(path))  # no lm_head key
    skeleton = model_skeleton(spec)
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight
    one_copy = load_peak_bytes(skeleton, None, dtype=torch.float32)
    loaded = load_quantized(skeleton, path, QuantSetting(), "cpu", dtype=torch.float32, targets=[])
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    head = allocator_size(model.lm_head.weight.numel() * 4)
    distinct = sum(allocator_size(p.numel() * 4) for p in model.parameters())  # parameters() yields a tie once
    buffers = sum(allocator_size(b.numel() * b.element_size()) for b in model.buffers())
    assert one_copy == distinct + buffers and head > 0
