"""``python -m memopt.calibration list | clear``: the planner's stored calibrations (``memopt.guard.calibration``)."""
