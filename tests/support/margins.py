"""Every tolerance check of the suite goes through `assert_within`, which also records how close each
measured error came to its bound: `TLALOC_TOLERANCE_REPORT=1 pytest ...` prints the closest ones, the
way to see each bound's margin on another CPU (make test-isa)."""

from __future__ import annotations

RECORDS: list[tuple[float, str, float, float]] = []


def assert_within(err: float, bound: float, what: str) -> None:
    RECORDS.append((err / bound if bound else float("inf"), what, err, bound))
    assert err <= bound, f"{what}: {err:.3g} is over the tolerance model's bound {bound:.3g}"


NEAR_TIES: list = []      # oracle.NearTie records: greedy ids that parted from the oracle's at a near-tie
