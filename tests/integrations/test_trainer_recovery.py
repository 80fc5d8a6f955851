"""memopt.wrap(trainer): the plan as TrainingArguments, the micro-batches inside training_step, and OOM recovery
under the Trainer (fault injected in forward and in backward): training goes on and ends with the parameters of a
run that switched to the escalated plan at that step without an error."""

import functools

import pytest
import torch

pytest.importorskip("transformers")

import memopt
from memopt.models import build_model

SEQ = 32
STEPS = 4


def _trainer(tmp_path, *, per_device: int = 2, accumulation: int = 4, unlabelled_every: int = 0,
             optim: str = "adamw_torch"):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = build_model("tiny_llama", device="cpu")
    g = torch.Generator().manual_seed(1)
    data = []
    for i in range(64):
        ids = torch.randint(3, 256, (SEQ,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, SEQ // 2, (1,), generator=g))] = -100  # uneven loss tokens per sample
        if unlabelled_every and i % unlabelled_every == 1:
            labels[:] = -100  # a prompt with no answer left after truncation: no token carries loss
        data.append({"input_ids": ids, "labels": labels})
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=per_device,
                             gradient_accumulation_steps=accumulation, max_steps=STEPS, learning_rate=1e-2,
                             lr_scheduler_type="constant", optim=optim, report_to=[], use_cpu=True,
                             save_strategy="no", logging_strategy="no", seed=0, data_seed=0, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=data)


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _wrap(trainer, **kw):
    return memopt.wrap(trainer, budget="4GB", hardware="h200", **kw)


def test_micro_batches_inside_training_step_match_the_trainers_own_accumulation(tmp_path):
    plain = _trainer(tmp_path / "a")
    plain.train()
    wrapped = _wrap(_trainer(tmp_path / "b"), pins={"micro_batch_size": 2, "precision": "fp32",
                                                     "optimizer": "adamw"})
    assert wrapped.args.per_device_train_batch_size == 8 and wrapped.args.gradient_accumulation_steps == 1
    assert wrapped.memopt_plan.strategy.micro_batch_size == 2
    wrapped.train()
    # the same samples per optimizer step, token-weighted: the same training up to float summation order
    for k, v in _params(plain.model).items():
        torch.testing.assert_close(wrapped.model.get_parameter(k), v, rtol=1e-4, atol=1e-6)


def test_a_micro_batch_without_a_labelled_token_adds_nothing_rather_than_nan(tmp_path):
    """Its mean loss is 0/0; the Trainer's own accumulation divides its sum by the batch's tokens, so it adds 0.
    SGD: Adam would turn float summation order into visible differences where a gradient is near 0."""
    plain = _trainer(tmp_path / "a", unlabelled_every=4, optim="sgd")
    want = plain.train().training_loss
    wrapped = _wrap(_trainer(tmp_path / "b", unlabelled_every=4, optim="sgd"),
                    pins={"micro_batch_size": 1, "precision": "fp32", "optimizer": "sgd"})
    assert wrapped.train().training_loss == pytest.approx(want, rel=1e-5)  # not NaN
    for k, v in _params(plain.model).items():
        assert torch.isfinite(wrapped.model.get_parameter(k)).all(), k
        torch.testing.assert_close(wrapped.model.get_parameter(k), v, rtol=1e-4, atol=1e-6)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers 5 renames gradient_checkpointing_enable
def test_a_model_that_checkpoints_itself_is_checkpointed_as_the_plan_says_under_the_trainer(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    wrapped = _wrap(trainer, pins={"checkpointing": "none", "precision": "fp32", "optimizer": "adamw"})
    assert wrapped.memopt_plan.strategy.checkpointing.mode == "none"
    assert not wrapped.model.is_gradient_checkpointing and not wrapped.args.gradient_checkpointing


class _OOMAt:
    """An out-of-memory error at the ``call``-th model forward (``where="forward"``) or in the backward of
    that forward (``where="backward"``: after some gradients were accumulated)."""

    def __init__(self, model, call: int, where: str) -> None:
        self.calls, self.fired = 0, False
        original = model.forward

        @functools.wraps(original)  # the Trainer keeps the dataset columns the forward's signature names
        def forward(*args, **kwargs):
            self.calls += 1
            if self.calls == call and where == "forward":
                self.fired = True
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB.")
            out = original(*args, **kwargs)
            if self.calls == call and where == "backward":
                def boom(grad):
                    self.fired = True
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB.")
                out.logits.register_hook(boom)  # mid-backward: the LM head's gradients are in by then
            return out

        model.forward = forward


@pytest.fixture(scope="module")
def first_plan(tmp_path_factory):
    """A plan memopt makes for the Trainer (restricted to what it can express), applied as a saved plan below:
    recovery then escalates without a profile (``step_down``: halve the micro-batch, then checkpoint)."""
    return _wrap(_trainer(tmp_path_factory.mktemp("plan")), pins={"precision": "fp32", "optimizer": "adamw"}
                 ).memopt_plan


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_oom_under_the_trainer_is_recovered_and_training_is_unchanged(tmp_path, where, first_plan):
    first = first_plan
    faulty = _wrap(_trainer(tmp_path / "a"), plan=first)
    per_step = len(range(0, 8, first.strategy.micro_batch_size))
    fault = _OOMAt(faulty.model, call=2 * per_step + 1, where=where)  # the first forward of step 2 (0-based)
    faulty.train()
    assert fault.fired and faulty.state.global_step == STEPS
    report = faulty.memopt_recovery.report
    assert len(report.failures) == 1 and report.failures[0].step == 2 and len(report.replans) == 1
    escalated = faulty.memopt_plan
    assert escalated.strategy != first.strategy
    assert escalated.strategy.global_batch == first.strategy.global_batch  # no sample skipped

    # the reference: no error, the escalated plan from step 2 on
    from transformers import TrainerCallback

    reference = _wrap(_trainer(tmp_path / "b"), plan=first)

    class Switch(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                reference.memopt_recovery._apply(escalated, reference.model, 1)

    reference.add_callback(Switch())
    reference.train()
    for k, v in _params(reference.model).items():
        assert torch.equal(faulty.model.get_parameter(k), v), k


def test_recovery_gives_up_with_a_report_and_the_state_untouched(tmp_path):
    from memopt.guard.oom import MemoptOOMError

    trainer = _wrap(_trainer(tmp_path), pins={"precision": "fp32", "optimizer": "adamw", "micro_batch_size": 8})
    before = _params(trainer.model)
    original = trainer.model.forward

    @functools.wraps(original)
    def always(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    trainer.model.forward = always
    with pytest.raises(MemoptOOMError, match=r"no smaller plan|gave up") as err:
        trainer.train()
    trainer.model.forward = original
    assert err.value.report.failures and all(torch.equal(trainer.model.get_parameter(k), v)
                                             for k, v in before.items())
    assert all(p.grad is None for p in trainer.model.parameters())


# -- an OOM inside the Trainer's optimizer step -------------------------------------------------------------
class _OOMInForeachSqrt:
    """``torch._foreach_sqrt`` (AdamW's foreach update, after the weight decay and the moments were applied to
    the first parameter group) raises an OOM at its ``call``-th call, ``times`` calls in a row."""

    def __init__(self, monkeypatch, call: int, times: int = 1) -> None:
        self.calls, self.fired = 0, 0
        original = torch._foreach_sqrt

        def sqrt(*args, **kwargs):
            self.calls += 1
            if call <= self.calls < call + times:
                self.fired += 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 MiB.")
            return original(*args, **kwargs)

        monkeypatch.setattr(torch, "_foreach_sqrt", sqrt)


def _foreach_trainer(path, plan, **wrap_kw):
    """The test Trainer with AdamW forced to its foreach implementation (the CUDA default; a CPU's is the loop)
    and weight decay, so that a failed update has changed parameters before it fails."""
    trainer = _trainer(path)
    trainer.args.weight_decay = 0.1
    trainer.create_optimizer()
    for group in trainer.optimizer.param_groups:
        group["foreach"] = True
    return _wrap(trainer, plan=plan, **wrap_kw)


def _groups_per_step(trainer) -> int:
    return sum(1 for g in trainer.optimizer.param_groups if g["params"])


def test_an_oom_inside_the_optimizer_step_is_undone_and_the_step_rerun_one_tensor_at_a_time(tmp_path, monkeypatch,
                                                                                           first_plan):
    from transformers import TrainerCallback

    faulty = _foreach_trainer(tmp_path / "a", first_plan, transaction="always")
    groups = _groups_per_step(faulty)
    assert groups == 2  # decay and no-decay: the fault below hits the second, after the first was updated
    fault = _OOMInForeachSqrt(monkeypatch, call=2 * groups + 2)  # step 2, second parameter group
    faulty.train()
    assert fault.fired == 1 and faulty.state.global_step == STEPS
    report = faulty.memopt_recovery.report
    (failure,) = report.failures
    assert (failure.step, failure.phase, failure.location) == (2, "optimizer", "optimizer")
    (switch,) = report.replans
    assert "foreach" in switch["from"] and "loop" in switch["to"] and switch["where"] == "optimizer"
    assert faulty.memopt_plan.strategy.optimizer == "adamw"
    assert all(g["foreach"] is False for g in faulty.optimizer.param_groups)
    monkeypatch.undo()

    # the reference: no error, the optimizer switched to the loop at step 2
    reference = _foreach_trainer(tmp_path / "b", first_plan)

    class Switch(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                for g in reference.optimizer.param_groups:
                    g["foreach"] = False

    reference.add_callback(Switch())
    reference.train()
    for k, v in _params(reference.model).items():
        assert torch.equal(faulty.model.get_parameter(k), v), k
    ref_state = reference.optimizer.state_dict()["state"]
    for i, st in faulty.optimizer.state_dict()["state"].items():
        assert all(torch.equal(st[n], ref_state[i][n]) for n in ("step", "exp_avg", "exp_avg_sq")), i


def test_an_optimizer_step_that_keeps_failing_gives_up_with_parameters_and_states_as_before(tmp_path, first_plan):
    from transformers import TrainerCallback

    from memopt.guard.oom import MemoptOOMError

    trainer = _foreach_trainer(tmp_path, first_plan, transaction="always")
    seen = {}

    def fail(optimizer, args, kwargs):  # inside the step, after memopt's copy: changes a parameter, then fails
        with torch.no_grad():
            optimizer.param_groups[0]["params"][0].add_(1.0)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 MiB.")

    class Keep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 1:
                seen["params"] = _params(trainer.model)
                seen["state"] = {i: {k: v.clone() for k, v in st.items()}
                                 for i, st in trainer.optimizer.state_dict()["state"].items()}
                trainer.optimizer.optimizer.register_step_pre_hook(fail)

    trainer.add_callback(Keep())
    with pytest.raises(MemoptOOMError, match="as before the step") as err:
        trainer.train()
    assert len(err.value.report.failures) == 3 and trainer.state.global_step == 1
    assert all(torch.equal(trainer.model.get_parameter(k), v) for k, v in seen["params"].items())
    for i, st in trainer.optimizer.state_dict()["state"].items():
        assert all(torch.equal(v, seen["state"][i][k]) for k, v in st.items()), i


def test_an_optimizer_oom_without_a_copy_says_the_parameters_are_partly_updated(tmp_path, monkeypatch, first_plan):
    from memopt.guard.oom import MemoptOOMError

    trainer = _foreach_trainer(tmp_path, first_plan, transaction="never")
    _OOMInForeachSqrt(monkeypatch, call=_groups_per_step(trainer) + 2)  # step 1, the second group
    with pytest.raises(MemoptOOMError, match="partly updated"):
        trainer.train()


def test_the_first_optimizer_step_is_copied_under_auto(tmp_path, monkeypatch, first_plan):
    """Under "auto" the first step (the states are created then) is copied first: an OOM in it is undone."""
    trainer = _foreach_trainer(tmp_path, first_plan)
    fault = _OOMInForeachSqrt(monkeypatch, call=2)  # step 0, the second group
    trainer.train()
    assert fault.fired == 1 and trainer.state.global_step == STEPS
    step = trainer.memopt_recovery.optimizer_step
    assert step.transaction.mode == "auto" and step.oom_seen
    assert [f.location for f in trainer.memopt_recovery.report.failures] == ["optimizer"]


def test_an_unknown_transaction_mode_is_refused_with_the_choices(tmp_path, first_plan):
    with pytest.raises(ValueError, match="auto, always, never"):
        _wrap(_trainer(tmp_path), plan=first_plan, transaction="sometimes")


def test_the_cache_is_released_after_the_failed_attempts_temporaries_are_gone(tmp_path, monkeypatch, first_plan):
    """The allocator's cache is emptied once the failed attempt's frames are gone: a temporary the failing update
    held is free by then (emptied while the error was being handled, its blocks would stay cached, fragmented)."""
    import weakref

    from transformers import TrainerCallback

    from memopt.integrations import trainer_optimizer_step as tos

    trainer = _foreach_trainer(tmp_path, first_plan, transaction="always")
    temporaries, alive_at_release = [], []

    def fail_once(optimizer, args, kwargs):
        if not temporaries:
            scratch = torch.empty(1 << 16)  # held by this frame when the error leaves it
            temporaries.append(weakref.ref(scratch))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 MiB.")

    class Arm(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == 1 and not temporaries:
                trainer.optimizer.optimizer.register_step_pre_hook(fail_once)

    real_release = tos.release_cache
    monkeypatch.setattr(tos, "release_cache", lambda: (alive_at_release.append(temporaries[0]() is not None),
                                                       real_release()))
    trainer.add_callback(Arm())
    trainer.train()
    assert trainer.state.global_step == STEPS and alive_at_release == [False]
