"""Shared fixtures: a profile cache per worker, no dispatch mode or SDPA backend flag left behind by a test, and
transformers stays quiet."""

from __future__ import annotations

import os
import warnings

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore", message=".*loss_type=None.*")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "memopt-cache"))


@pytest.fixture(autouse=True)
def _no_mode_left_entered():
    """A dispatch mode a test leaves entered (a tracker whose ``__exit__`` an injected failure skipped) changes what
    every later test in the process computes: it is popped here, and the test that left it fails."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

    yield
    left = [type(m).__name__ for m in _get_current_dispatch_mode_stack()]
    while _get_current_dispatch_mode_stack():
        _pop_mode()
    assert not left, f"the test left dispatch modes entered: {left}"


_SDPA_FLAGS = ("flash", "mem_efficient", "cudnn", "math")


@pytest.fixture(autouse=True)
def _sdpa_backends_unchanged():
    """No test may leave torch's process-wide SDPA backend flags changed: memopt restricts them only around its own
    passes, and a leak moves every later trace of the worker to other kernels (the golden plans of attention models
    moved by up to 29% in CI when memopt still set them for as long as a model stayed wrapped). A test that leaks
    fails, and the flags are put back for the tests after it."""
    import torch

    cuda = torch.backends.cuda
    before = {f: getattr(cuda, f"{f}_sdp_enabled")() for f in _SDPA_FLAGS}
    yield
    changed = {flag: enabled for flag, enabled in before.items() if getattr(cuda, f"{flag}_sdp_enabled")() != enabled}
    for flag, enabled in changed.items():
        getattr(cuda, f"enable_{flag}_sdp")(enabled)
    assert not changed, f"the test left SDPA backend flags changed: {sorted(changed)}"


@pytest.fixture(autouse=True)
def _autocast_unchanged():
    """No test may leave autocast turned on: every later forward of the worker would run in reduced precision (and
    a check that needs fp32, such as the Trainer path's padding check, would not get it). A test that leaks fails,
    and autocast is turned off again for the tests after it."""
    import torch

    devices = ("cpu", "cuda")
    before = {d: torch.is_autocast_enabled(d) for d in devices}
    yield
    changed = [d for d in devices if torch.is_autocast_enabled(d) != before[d]]
    for d in changed:
        torch.set_autocast_enabled(d, before[d])
    assert not changed, f"the test left autocast changed on {changed}"


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """No test may leave a torch.distributed process group it started: every later Trainer of the worker would take
    itself for one rank of a job (accelerate wraps its model in DDP), as a failed one-GPU offload wrap once did."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a torch.distributed process group initialized")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Under scripts/test.sh a skip is a test that did not run: only a missing GPU may excuse it. A skip for a missing
# package (importorskip) or an unbuilt extension would let an incomplete install pass as green.
_EXCUSED_SKIPS = ("needs a CUDA GPU", "needs 2 CUDA GPUs", "needs several CUDA GPUs")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or os.environ.get("MEMOPT_STRICT_SKIPS") != "1" or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not any(excuse in reason for excuse in _EXCUSED_SKIPS):
        report.outcome = "failed"
        report.longrepr = (f"skipped under MEMOPT_STRICT_SKIPS=1 ({reason}): every test but the GPU ones must run "
                           "here; install what it needs (see the README's test command)")
