"""What of the budget is gone before memopt.wrap applies its plan, and the re-plan for what is left."""

import pytest
import torch

from memopt.step.hard_cap import ROOM_TAKEN_THRESHOLD, room_taken_bytes

GiB = 2**30
RUNTIME = 804_044_800  # the H200's predicted CUDA runtime outside the allocator


def test_a_clean_process_takes_nothing_from_the_budget():
    # CUDA's context alone is below the runtime the plan predicts (cuBLAS and kernels come later)
    assert room_taken_bytes(outside_bytes=500 * 2**20, runtime_bytes=RUNTIME, allocated_bytes=0, model_bytes=0) == 0


def test_memory_outside_the_allocator_beyond_the_runtime_is_taken():
    outside = RUNTIME + 900 * 2**20  # e.g. another process NVML could not tell apart
    assert room_taken_bytes(outside_bytes=outside, runtime_bytes=RUNTIME, allocated_bytes=0,
                            model_bytes=0) == 900 * 2**20


def test_tensors_that_are_not_the_models_are_taken_and_the_models_own_are_not():
    model = 3 * GiB
    assert room_taken_bytes(outside_bytes=0, runtime_bytes=RUNTIME, allocated_bytes=model, model_bytes=model) == 0
    assert room_taken_bytes(outside_bytes=0, runtime_bytes=RUNTIME, allocated_bytes=model + 4 * GiB,
                            model_bytes=model) == 4 * GiB
    both = room_taken_bytes(outside_bytes=RUNTIME + GiB, runtime_bytes=RUNTIME, allocated_bytes=model + 2 * GiB,
                            model_bytes=model)
    assert both == 3 * GiB


def test_below_the_threshold_is_the_runtimes_own_variation():
    small = ROOM_TAKEN_THRESHOLD - 1
    assert room_taken_bytes(outside_bytes=RUNTIME + small, runtime_bytes=RUNTIME, allocated_bytes=0,
                            model_bytes=0) == 0
    assert room_taken_bytes(outside_bytes=RUNTIME + ROOM_TAKEN_THRESHOLD, runtime_bytes=RUNTIME, allocated_bytes=0,
                            model_bytes=0) == ROOM_TAKEN_THRESHOLD


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_wrap_plans_for_what_an_evaluation_model_leaves(tmp_path):
    import memopt
    from memopt.models import SampleSpec, build_model, make_batch, with_overrides

    spec = with_overrides("tiny_llama", {"num_hidden_layers": 4})
    sample = {"batch_size": 8, "seq_len": 256}
    hog = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")  # what the plan does not own
    model = build_model(spec, device="cpu")
    w = memopt.wrap(model, budget="6GiB", sample=sample, run_dir=tmp_path, autotune=False)
    assert any("already in use on the device" in n for n in w.plan.notes)
    assert w.plan.budget_bytes <= 6 * GiB - 2 * GiB
    w.step(make_batch(spec, SampleSpec.parse(sample, spec), device="cuda"))
    assert torch.cuda.max_memory_reserved() + 0 <= w.cap_fraction * torch.cuda.get_device_properties(0).total_memory
    del hog


def _wrapped_on_cpu():
    import memopt
    from memopt.models import build_model, with_overrides

    model = build_model(with_overrides("tiny_llama", {"num_hidden_layers": 2}), device="cpu")
    return memopt.wrap(model, budget="6GiB", sample={"batch_size": 8, "seq_len": 256}, hardware="h200",
                       device="cpu", autotune=False)


def test_the_re_plan_uses_what_is_left_and_the_cap_keeps_the_users_budget():
    w = _wrapped_on_cpu()
    full = w.plan
    smaller = w._plan_for_room_left(full, w._plan_pins, 4 * GiB)
    assert smaller.fits and smaller.budget_bytes == full.budget_bytes - 4 * GiB
    assert smaller.total_bytes <= smaller.budget_bytes < full.budget_bytes
    assert w._cap_budget_bytes == full.budget_bytes  # the cap subtracts what is outside the allocator itself
    assert "4.00 GiB of the 6.00 GiB budget was already in use" in smaller.notes[-1]


def test_nothing_fits_in_what_is_left_names_the_memory_in_use():
    w = _wrapped_on_cpu()
    with pytest.raises(ValueError, match=r"5.00 GiB of the 6.00 GiB budget was already in use.*no plan fits in the "
                                         r"1.00 GiB left.*free that memory or raise the budget"):
        w._plan_for_room_left(w.plan, w._plan_pins, 5 * GiB)


def test_too_little_left_to_plan_with_names_the_memory_in_use_not_the_margin():
    w = _wrapped_on_cpu()
    with pytest.raises(ValueError, match=r"^[^\n]*6.00 GiB of the 6.00 GiB budget was already in use.*the 0 B left "
                                         r"is too little to plan with.*free that memory or raise the budget"):
        w._plan_for_room_left(w.plan, w._plan_pins, 6 * GiB)

