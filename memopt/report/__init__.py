"""``python -m memopt.report RUN_DIR``: timelines, predicted vs measured, and OOM post-mortems of a run."""

from memopt.guard.report import load_run, postmortem, render_report, summarize

__all__ = ["load_run", "postmortem", "render_report", "summarize"]
