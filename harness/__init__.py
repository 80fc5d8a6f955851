"""The GPU measurement harness behind ``scripts/*_gpu.py`` and the benchmarks: measured rows, their predictions,
the case matrices. It is not part of the shipped package (``pyproject.toml`` packages ``memopt`` only); scripts and
tests import it from the repository root."""
