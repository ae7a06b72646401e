"""The kernel checks' runner (tests/kernels/_runner.py)."""
from __future__ import annotations

from tests.kernels._runner import DEFAULT_COST, INTERPRETED_COST, all_checks, interpreted_groups


def test_interpreted_checks_split_into_two_processes_of_about_equal_cost():
    """Every kernel check of every file runs interpreted exactly once, in one of two processes whose costs differ by
    less than the costliest check (a new check, not yet timed, counts DEFAULT_COST)."""
    checks = all_checks()
    groups = interpreted_groups(checks)
    assert len(groups) == 2 and sorted(n for g in groups for n in g) == sorted(checks)
    cost = [sum(INTERPRETED_COST.get(n, DEFAULT_COST) for n in g) for g in groups]
    assert abs(cost[0] - cost[1]) <= max(INTERPRETED_COST.values())
    assert set(INTERPRETED_COST) <= set(checks), "a timed check that no longer exists"
    assert interpreted_groups(["a"]) == [["a"]]
    assert len(checks) >= 35 and "gemv" in checks and "extend_attention" in checks  # the files' checks were found
