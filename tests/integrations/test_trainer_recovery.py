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


def _trainer(tmp_path, *, per_device: int = 2, accumulation: int = 4):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = build_model("tiny_llama", device="cpu")
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(64):
        ids = torch.randint(3, 256, (SEQ,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(0, SEQ // 2, (1,), generator=g))] = -100  # uneven loss tokens per sample
        data.append({"input_ids": ids, "labels": labels})
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=per_device,
                             gradient_accumulation_steps=accumulation, max_steps=STEPS, learning_rate=1e-2,
                             lr_scheduler_type="constant", optim="adamw_torch", report_to=[], use_cpu=True,
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
    from memopt.guard.recovery import MemoptOOMError

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
