"""``python -m memopt.report RUN_DIR``: timelines, predicted vs measured, and OOM post-mortems of a run.

``render_report`` writes the guard's report (``memopt.guard.report``) and, when the run recorded a step by
module (``memopt.wrap`` with ``run_dir=``), where its bytes went beside the prediction
(``memopt.report.attribution``: ``attribution.md``, ``attribution.html``, ``attribution_timeline.png``).
"""

from __future__ import annotations

import os
from pathlib import Path

from memopt.guard.report import load_run, postmortem, summarize
from memopt.guard.report import render_report as _render_guard_report
from memopt.report.attribution import has_attribution, render_attribution

__all__ = ["load_run", "postmortem", "render_attribution", "render_report", "summarize"]


def render_report(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None, *,
                  rank: int = 0) -> dict[str, Path]:
    """Every report file of a run directory (default folder ``RUN_DIR/report``); returns their paths by name."""
    try:
        paths = _render_guard_report(run_dir, out_dir, rank=rank)
    except FileNotFoundError:  # a run with no telemetry (a Hugging Face Trainer's): its recorded step only
        if not has_attribution(run_dir, rank=rank):
            raise
        paths = {}
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    paths.update(render_attribution(run_dir, out, rank=rank))
    return paths
