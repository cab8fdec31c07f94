"""``Coordinator.try_reserve_up_to`` over a real Redis: as many groups as the staleness budget
allows, up to the number asked for, in one atomic call (streaming admission)."""
from __future__ import annotations

import threading

import pytest

from streamrl.coord.coordinator import Coordinator

PER_STEP, STALENESS = 4, 1
LIMIT_AT_0 = (0 + STALENESS + 1) * PER_STEP  # the budget at version 0


def _coord(redis_url, run_id, version: int = 0) -> Coordinator:
    c = Coordinator(redis_url, run_id)
    c.r.set(c.keys.version, version)
    return c


@pytest.mark.timeout(30)
def test_grants_what_is_asked_up_to_the_limit_then_part_then_none(redis_url, run_id):
    c = _coord(redis_url, run_id)
    assert c.try_reserve_up_to(3, STALENESS, PER_STEP) == 3
    assert c.try_reserve_up_to(LIMIT_AT_0, STALENESS, PER_STEP) == LIMIT_AT_0 - 3  # partly: what is left
    assert c.held_groups() == LIMIT_AT_0
    assert c.try_reserve_up_to(2, STALENESS, PER_STEP) == 0  # full
    assert c.held_groups() == LIMIT_AT_0
    c.refund(1)
    assert c.try_reserve_up_to(5, STALENESS, PER_STEP) == 1  # a refund makes room again


@pytest.mark.timeout(30)
def test_grants_nothing_before_the_first_version(redis_url, run_id):
    c = Coordinator(redis_url, run_id)
    assert c.try_reserve_up_to(2, STALENESS, PER_STEP) == 0 and c.held_groups() == 0


@pytest.mark.timeout(30)
def test_the_budget_follows_the_version_and_the_published_bound(redis_url, run_id):
    c = _coord(redis_url, run_id)
    assert c.try_reserve_up_to(100, STALENESS, PER_STEP) == LIMIT_AT_0
    c.r.set(c.keys.version, 2)  # the learner advanced two versions: two steps more
    assert c.try_reserve_up_to(100, STALENESS, PER_STEP) == 2 * PER_STEP
    c.r.set(c.keys.version, 3)
    c.set_staleness_bound(0)  # the learner tightened the bound: (3 + 0 + 1) * PER_STEP, all held
    assert c.try_reserve_up_to(100, STALENESS, PER_STEP) == 0
    c.set_staleness_bound(5)  # a published bound above the worker's max_staleness: the worker's holds
    assert c.try_reserve_up_to(100, STALENESS, PER_STEP) == PER_STEP
    assert c.held_groups() == (3 + STALENESS + 1) * PER_STEP


@pytest.mark.timeout(30)
def test_all_or_nothing_is_kept_for_batches(redis_url, run_id):
    """``try_reserve`` (a batch needs every group) refuses what ``try_reserve_up_to`` grants in part."""
    c = _coord(redis_url, run_id)
    assert c.try_reserve(LIMIT_AT_0 - 1, STALENESS, PER_STEP)
    assert not c.try_reserve(2, STALENESS, PER_STEP) and c.held_groups() == LIMIT_AT_0 - 1
    assert c.try_reserve_up_to(2, STALENESS, PER_STEP) == 1 and c.held_groups() == LIMIT_AT_0


@pytest.mark.timeout(60)
def test_concurrent_callers_never_grant_more_than_the_budget(redis_url, run_id):
    """Threads, each with its own connection, reserve 1..3 groups at a time while the version
    advances: the groups held never exceed the budget, and together they end up holding exactly
    the budget of the final version."""
    final_version, threads = 5, 4
    c = _coord(redis_url, run_id)
    granted, over = [0] * threads, []
    start = threading.Barrier(threads + 1)

    def hammer(i: int) -> None:
        mine = Coordinator(redis_url, run_id)
        start.wait()
        for j in range(1000):
            n = mine.try_reserve_up_to(1 + (i + j) % 3, STALENESS, PER_STEP)
            granted[i] += n
            held = mine.held_groups()  # before the version: the budget read after it is no smaller
            version = int(mine.r.get(mine.keys.version))
            if held > (version + STALENESS + 1) * PER_STEP:
                over.append((held, version))
            if n == 0 and version == final_version:
                return

    workers = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(threads)]
    for t in workers:
        t.start()
    start.wait()
    for v in range(1, final_version + 1):
        c.r.set(c.keys.version, v)
    for t in workers:
        t.join(30)
    assert not over
    assert sum(granted) == c.held_groups() == (final_version + STALENESS + 1) * PER_STEP
