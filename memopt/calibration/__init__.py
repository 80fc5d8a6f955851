"""``python -m memopt.calibration list | clear``: the stored calibrations (``memopt.estimate.calibration``)."""
