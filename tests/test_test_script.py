"""scripts/test.sh exits 0 only when every selected test ran and passed, in every tier it was asked to run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each case runs pytest twice in a subprocess

_PYPROJECT = """[tool.pytest.ini_options]
testpaths = ["tests"]
markers = ["slow: slow", "gpu: gpu"]
addopts = "-ra --strict-markers"
"""


def _project(tmp_path: Path, body: str) -> Path:
    """A copy of the test script and conftest around one test module, so the script runs as it does here."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "test_cases.py").write_text("import os\nimport pytest\n\n" + body)
    (tmp_path / "pyproject.toml").write_text(_PYPROJECT)
    return tmp_path


def _run(project: Path, *args: str) -> subprocess.CompletedProcess:
    # the system preparation (DeepSpeed's compiled ops) is not what these cases check
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(project), "MEMOPT_SKIP_PREPARE": "1"}
    return subprocess.run(["bash", str(project / "scripts" / "test.sh"), *args], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300)


_PASS = "def test_fast():\n    assert True\n\n@pytest.mark.slow\ndef test_slow():\n    assert True\n"


def test_passing_suite_exits_zero_and_says_which_tiers_ran(tmp_path):
    project = _project(tmp_path, _PASS)
    whole = _run(project)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "fast and slow tiers" in whole.stdout
    fast = _run(project, "fast")
    assert fast.returncode == 0 and "slow tier was NOT run" in fast.stdout


@pytest.mark.parametrize("body", [
    "def test_fails():\n    assert False\n",
    "def test_missing_package():\n    pytest.importorskip('memopt_no_such_package')\n",
    "def test_interrupted():\n    pytest.exit('stopped half way', returncode=2)\n",
    "def test_worker_dies():\n    os._exit(1)\n",
    "import memopt_no_such_package\n\ndef test_never_collected():\n    pass\n",
], ids=["failure", "skip-for-missing-package", "interrupt", "crashed-worker", "collection-error"])
def test_a_test_that_did_not_run_and_pass_fails_the_script(tmp_path, body):
    project = _project(tmp_path, _PASS + "\n" + body)
    out = _run(project)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "all tests passed" not in out.stdout


def test_a_tier_that_fails_stops_the_script_before_the_next(tmp_path):
    project = _project(tmp_path, _PASS + "\n@pytest.mark.slow\ndef test_slow_fails():\n    assert False\n")
    assert _run(project, "fast").returncode == 0
    assert _run(project).returncode != 0
    assert _run(project, "slow").returncode != 0


def test_a_gpu_skip_is_excused(tmp_path):
    project = _project(tmp_path, _PASS + "\n@pytest.mark.gpu\ndef test_needs_gpu():\n    pass\n")
    out = _run(project)
    assert out.returncode == 0, out.stdout + out.stderr
