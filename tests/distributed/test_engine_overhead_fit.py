"""DeepSpeed's fixed work per micro-batch in ``TimingParams`` is what ``scripts/fit_engine_overhead.py`` fits to the
committed H200 rows: the constants cannot drift from the data, and the data's rows are predicted within their
spread once the fitted overhead is in."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from memopt.distributed.timing import TimingParams

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_deepspeed_overhead_constants_are_the_fit_of_the_h200_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import fit_engine_overhead as fit
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    obs = [fit.observe(r, p) for r, p in fit.ROWS]
    tp = TimingParams()
    z3 = [o for o in obs if o["stage"] == 3]
    z12 = [o for o in obs if o["stage"] in (1, 2)]
    c3, _ = fit._fit(z3, per_param=False)
    c12, d12 = fit._fit(z12, per_param=True)
    assert tp.deepspeed_tensor_overhead_s == pytest.approx(c3, rel=0.01)
    assert tp.deepspeed_z12_tensor_overhead_s == pytest.approx(c12, rel=0.01)
    assert tp.deepspeed_z12_param_overhead_s * 1e9 == pytest.approx(d12, rel=0.01)
    # with the fitted terms every ZeRO-1/2 row is within 5% and every ZeRO-3 row within the repeat runs' spread
    for o in z12:
        assert abs(fit._predict(o, c12, d12) / o["measured_mean_s"] - 1) <= 0.05, o["row"]
    for o in z3:
        assert abs(fit._predict(o, c3, 0.0) / o["measured_mean_s"] - 1) <= 0.16, o["row"]
