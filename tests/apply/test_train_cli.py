import json
import subprocess
import sys


def test_train_cli_runs_a_tiny_recipe_and_resumes(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "memopt.train", "--model", "tiny_llama", "--budget", "4GB", "--steps", "4",
           "--batch-size", "4", "--seq-len", "32", "--hardware", "h100_80gb", "--run-dir", str(run)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert (run / "checkpoint.pt").exists() and (run / "plan.json").exists()
    log = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    again = subprocess.run([*cmd[:8], "8", *cmd[9:], "--resume"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    log = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6, 7, 8]  # continued at step 5, nothing repeated
    # the run directory is one that `memopt.report` reads: every trained step's telemetry, timelines as PNG
    report = subprocess.run([sys.executable, "-m", "memopt.report", str(run)], capture_output=True, text=True,
                            timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    assert report.stdout.startswith("8 steps")
    png = (run / "report" / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_cli_bad_model_is_explained(tmp_path):
    out = subprocess.run([sys.executable, "-m", "memopt.train", "--model", "lama3", "--run-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "llama" in out.stderr


def test_train_cli_refuses_a_step_count_that_is_not_positive_and_an_unwritable_run_dir(tmp_path):
    from memopt.train.__main__ import main

    assert main(["--model", "tiny_llama", "--steps", "0", "--run-dir", str(tmp_path)]) == 2
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the run directory would go
    assert main(["--model", "tiny_llama", "--steps", "1", "--hardware", "h100_80gb",
                 "--run-dir", str(blocker / "run")]) == 2
