"""``python -m memopt.report`` on damaged run files: a corrupt telemetry.jsonl is reported as corrupt (not as
missing), one line, exit 2; a line cut short by a crash is skipped."""

from __future__ import annotations

import json

from memopt.guard.report import load_run
from memopt.report.__main__ import main


def test_corrupt_telemetry_is_named_corrupt(tmp_path, capsys):
    (tmp_path / "telemetry.jsonl").write_bytes(b"\x00\xff garbage\nnot json either\n")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "corrupt" in err and "telemetry.jsonl" in err and "no telemetry" not in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_missing_run_files_are_named_missing(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "has no telemetry.jsonl" in capsys.readouterr().err


def test_a_line_cut_short_is_skipped_and_a_corrupt_plan_is_named(tmp_path, capsys):
    good = {"step": 0, "attempts": 1, "loss": 1.0}
    (tmp_path / "telemetry.jsonl").write_text(json.dumps(good) + "\n" + '{"step": 1, "att')
    assert load_run(tmp_path).steps == [good]
    (tmp_path / "plan.json").write_text("{not json")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "plan.json is corrupt" in err and "Traceback" not in err
