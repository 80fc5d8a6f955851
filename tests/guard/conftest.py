import pytest
import torch


def _top_saved_tensor_hooks():
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, TypeError):  # private API: skip the check where it differs
        return None


@pytest.fixture(autouse=True)
def _one_thread_and_no_leftover_hooks():
    """Tiny models: one intra-op thread is faster, and deterministic on a loaded machine. A test must not
    leave saved-tensor hooks (the graph census) installed for the tests after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    assert _top_saved_tensor_hooks() is None, "saved-tensor hooks left installed (a Telemetry was not closed)"
