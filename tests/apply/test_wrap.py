"""memopt.wrap on a CPU: the API, lazy planning, reversibility, checkpoints, bad input."""

import warnings

import pytest
import torch
from torch import nn

import memopt
from memopt.models import SampleSpec, build_model, make_batch
from tests.reference_loop import losses_of_plain_loop

SAMPLE = {"batch_size": 8, "seq_len": 64}


def _batch(seed=0):
    return make_batch("tiny_llama", SampleSpec.parse(SAMPLE, "tiny_llama"),
                      generator=torch.Generator().manual_seed(seed))


def test_wrap_plans_applies_and_trains():
    torch.manual_seed(0)
    model = build_model("tiny_llama", device="cpu")
    w = memopt.wrap(model, budget="4GB", sample=SAMPLE, hardware="h100_80gb", lr=1e-3)
    assert w.plan.fits and w.model is model and isinstance(w.optimizer, torch.optim.Optimizer)
    losses = [w.step(_batch(i)) for i in range(3)]
    assert all(isinstance(x, float) for x in losses)
    assert w.steps_done == 3


def test_lazy_planning_from_the_first_batch():
    model = build_model("tiny_llama", device="cpu")
    w = memopt.wrap(model, budget="4GB", hardware="h100_80gb", lr=1e-3)
    assert w.plan is None
    with pytest.raises(ValueError, match="step"):
        _ = w.optimizer
    w.step(_batch())
    assert w.plan is not None and w.plan.global_batch == 8


def test_unwrap_restores_the_module_and_state_dict_loads():
    torch.manual_seed(0)
    model = build_model("tiny_llama", device="cpu")
    before = {k: v.dtype for k, v in model.state_dict().items()}
    w = memopt.wrap(model, budget="4GB", sample=SAMPLE, hardware="h100_80gb", lr=1e-3,
                    pins={"precision": "bf16_autocast", "checkpointing": "full"})
    w.step(_batch())
    module = w.unwrap()
    assert module is model and "forward" not in vars(model.model.layers[0])
    assert {k: v.dtype for k, v in module.state_dict().items()} == before
    fresh = build_model("tiny_llama", device="cpu")
    fresh.load_state_dict(module.state_dict())
    # training on would re-plan with a fresh optimizer, its moments lost without a word: refused, with what to do
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for use in (lambda: w.step(_batch(1)), lambda: w.optimizer, lambda: w.state_dict()):
        with pytest.raises(ValueError, match=r"was unwrapped .* wrap the model again"):
            use()
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_saved_plan_is_applied_unchanged(tmp_path):
    plan = memopt.plan("tiny_llama", SAMPLE, budget="4GB", hardware="h100_80gb")
    path = plan.save(tmp_path / "plan.json")
    w = memopt.wrap(build_model("tiny_llama", device="cpu"), plan=str(path), lr=1e-3)
    assert w.plan.strategy == plan.strategy


def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    w = memopt.wrap(build_model("tiny_llama", device="cpu"), budget="4GB", sample=SAMPLE, hardware="h100_80gb",
                    lr=1e-3)
    w.step(_batch(0))
    path = w.save(tmp_path / "ckpt.pt")
    next_loss = w.step(_batch(1))
    w2 = memopt.wrap(build_model("tiny_llama", device="cpu"), plan=w.plan, lr=1e-3)
    w2.load_state_dict(torch.load(path, weights_only=False))
    assert w2.steps_done == 1
    assert w2.step(_batch(1)) == pytest.approx(next_loss, rel=1e-6)


@pytest.mark.parametrize("where", ["existing folder", "new folder/"])
def test_checkpoint_to_a_folder_resumes(tmp_path, where):
    # the offload engines save to folders: a script that saves to one must work under a one-GPU plan too
    torch.manual_seed(0)
    w = memopt.wrap(build_model("tiny_llama", device="cpu"), budget="4GB", sample=SAMPLE, hardware="h100_80gb",
                    lr=1e-3)
    w.step(_batch(0))
    folder = tmp_path / "ckpt"
    if where == "existing folder":
        folder.mkdir()
        target = folder
    else:
        target = f"{folder}/"
    path = w.save(target)
    assert path == folder / "memopt_checkpoint.pt" and path.is_file()
    next_loss = w.step(_batch(1))
    w2 = memopt.wrap(build_model("tiny_llama", device="cpu"), plan=w.plan, lr=1e-3)
    w2.load(folder)
    assert w2.steps_done == 1
    assert w2.step(_batch(1)) == pytest.approx(next_loss, rel=1e-6)
    with pytest.raises(FileNotFoundError, match=r"no memopt checkpoint at .*memopt_checkpoint\.pt"):
        w2.load(tmp_path / "elsewhere")


def test_a_checkpoint_that_cannot_be_loaded_whole_changes_nothing(tmp_path):
    """A truncated file, and a checkpoint of another model, are refused in one line before anything is loaded (a
    checkpoint failing half-way would leave its weights beside the old optimizer state)."""
    torch.manual_seed(0)
    w = memopt.wrap(build_model("tiny_llama", device="cpu"), budget="4GB", sample=SAMPLE, hardware="h100_80gb",
                    lr=1e-3, pins={"micro_batch_size": 8})
    w.step(_batch(0))
    path = w.save(tmp_path / "ckpt.pt")
    good = path.read_bytes()
    torch.manual_seed(1)
    other = memopt.wrap(build_model("tiny_llama", device="cpu"), plan=w.plan, lr=1e-3)
    other.step(_batch(2))
    before = ({k: v.clone() for k, v in other.model.state_dict().items()}, str(other.optimizer.state_dict()))
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match=r"^the memopt checkpoint .*ckpt\.pt cannot be read \(.*\): it is truncated"):
        other.load(path)
    path.write_bytes(good)
    state = torch.load(path, weights_only=False)
    state["model"] = {k.replace("layers.1.", "layers.9."): v for k, v in state["model"].items()}
    with pytest.raises(ValueError, match=r"^this checkpoint was saved from another model .*lacks model\.layers\.1\."):
        other.load_state_dict(state)
    state = torch.load(path, weights_only=False)
    state["optimizer"]["param_groups"][0]["params"] = state["optimizer"]["param_groups"][0]["params"][:-1]
    with pytest.raises(ValueError, match=r"its optimizer has parameter groups of"):
        other.load_state_dict(state)
    assert all(torch.equal(v, before[0][k]) for k, v in other.model.state_dict().items())
    assert str(other.optimizer.state_dict()) == before[1] and other.steps_done == 1
    other.load(path)  # the good one loads
    assert other.steps_done == 1 and torch.equal(other.model.lm_head.weight, w.model.lm_head.weight)


def test_bad_input_is_explained():
    model = build_model("tiny_llama", device="cpu")
    with pytest.raises(ValueError, match="budget"):
        memopt.wrap(model)
    with pytest.raises(ValueError, match="40GB"):
        memopt.wrap(model, budget="40 gigs", hardware="h100_80gb")
    with pytest.raises(ValueError, match="meta"):
        memopt.wrap(build_model("tiny_llama"), budget="4GB", hardware="h100_80gb")
    with pytest.raises(ValueError, match="compile"):
        memopt.wrap(torch.compile(model), budget="4GB", hardware="h100_80gb")
    with pytest.raises(ValueError, match="optimizer"):
        memopt.wrap(model, budget="4GB", sample=SAMPLE, hardware="h100_80gb", optimizer="adagrad-ish")


def test_batchnorm_is_flagged_when_micro_batching():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64)) for _ in range(4))

        def forward(self, x, labels):
            for b in self.blocks:
                x = b(x)
            return {"loss": nn.functional.mse_loss(x, labels)}

    sample = {"x": torch.randn(16, 64), "labels": torch.randn(16, 64)}
    with pytest.warns(UserWarning, match="BatchNorm"):
        memopt.wrap(Net(), budget="4GB", sample=sample, hardware="h100_80gb", pins={"micro_batch_size": 4})


def test_batchnorm_frozen_in_eval_mode_is_micro_batched_exactly():
    """Fine-tuning with frozen BatchNorm statistics (the layers in eval mode, the model in training mode): each
    sample is normalized with the running statistics, so micro-batches are exact and not refused. A model wholly in
    eval mode is taken to train in training mode: refused."""
    from memopt.techniques.micro_batching import micro_batch_refusal

    def net() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
        model[1].eval()
        model[1].requires_grad_(False)
        return model

    assert micro_batch_refusal(net()) is None
    assert "BatchNorm" in (micro_batch_refusal(net().eval()) or "")
    assert "BatchNorm" in (micro_batch_refusal(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))) or "")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]
    loss_fn = lambda out, b: nn.functional.cross_entropy(out, b[1])  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "BatchNorm" warning: the split is exact
        w = memopt.wrap(net(), budget="4GB", sample=batches[0], hardware="h100_80gb", loss_fn=loss_fn,
                        pins={"micro_batch_size": 2, "precision": "fp32"}, guard=False, autotune=False,
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert not any("micro-batching refused" in n for n in w.plan.notes)
    got = [w.step(b) for b in batches]
    ref = net()
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    want = losses_of_plain_loop(ref, batches, lambda m, b: loss_fn(m(b[0]), b), opt)
    assert got == pytest.approx(want, rel=1e-5)


def test_custom_module_with_user_optimizer_and_loss():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(5))

        def forward(self, x, labels):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    sample = {"x": torch.randn(8, 32), "labels": torch.randn(8, 32)}
    w = memopt.wrap(Net(), budget="4GB", sample=sample, hardware="h100_80gb",
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                    loss_fn=lambda out, batch: nn.functional.mse_loss(out, batch["labels"]))
    assert isinstance(w.optimizer, torch.optim.SGD)
    first = w.step(sample)
    for _ in range(10):
        last = w.step(sample)
    assert last < first


@pytest.mark.parametrize("precision", ["bf16_master", "bf16_pure"])
def test_unwrap_after_a_cast_gives_back_the_users_parameters_with_what_they_trained(precision):
    """bf16_master: the fp32 masters are what trained; before, unwrap gave their bf16 rounding (3.7e-3 off) in new
    Parameter objects, so an EMA or optimizer of the user's held stale ones. A frozen weight comes back exactly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    model[0].requires_grad_(False)
    given = list(model.parameters())
    frozen = model[0].weight.detach().clone()
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(3)]
    w = memopt.wrap(model, budget="4GB", sample=batches[0], hardware="h100_80gb", device="cpu", guard=False,
                    use_cache=False, lr=1e-2, fidelity="mixed" if precision == "bf16_master" else "lossy",
                    pins={"precision": precision},
                    loss_fn=lambda out, b: nn.functional.cross_entropy(out.float(), b[1]))
    for b in batches:
        w.step(b)
    trained = ([m.detach().clone() for m in w._prepared.step.master.masters] if precision == "bf16_master"
               else [p.detach().float().clone() for p in w.model.parameters() if p.requires_grad])
    module = w.unwrap()
    assert all(a is b for a, b in zip(module.parameters(), given))
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert torch.equal(module[0].weight, frozen)
    for p, value in zip([p for p in module.parameters() if p.requires_grad], trained):
        assert torch.equal(p.detach(), value)
    if precision == "bf16_master":  # the masters' own values, not their bf16 rounding
        assert not all(torch.equal(p.detach(), p.detach().bfloat16().float()) for p in module[2].parameters())
