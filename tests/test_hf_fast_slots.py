"""Host bookkeeping of the fast engine's decode loop: step-counter slot table, version change points,
pinned host-to-device copies. Checked against the per-slot counters they replace."""
from __future__ import annotations

import random

import numpy as np
import torch

from streamrl.engines.host_io import to_device
from streamrl.engines.slot_table import SlotTable, VersionLog


def test_slot_table_matches_per_slot_counters():
    """Random fills, frees and steps: positions, tokens drawn, liveness, spans and block crossings
    equal what counters incremented for every live slot every step give."""
    rng = random.Random(0)
    batch, bs = 12, 4
    table = SlotTable(batch)
    owner, pos, gen, cap = [-1] * batch, [0] * batch, [0] * batch, [0] * batch
    request = 0
    for _ in range(400):
        free = [s for s in range(batch) if owner[s] < 0]
        if free and rng.random() < 0.3:
            fill = rng.sample(free, rng.randint(1, len(free)))
            lens, caps = [rng.randint(1, 9) for _ in fill], [rng.randint(1, 7) for _ in fill]
            table.admit(fill, list(range(request, request + len(fill))), lens, caps)
            for s, p, c in zip(fill, lens, caps):
                owner[s], pos[s], gen[s], cap[s], request = request, p, 1, c, request + 1
        held = [s for s in range(batch) if owner[s] >= 0]
        if held and rng.random() < 0.2:
            gone = rng.sample(held, rng.randint(1, len(held)))
            table.free(gone)
            for s in gone:
                owner[s] = -1
        live = [s for s in range(batch) if owner[s] >= 0 and gen[s] < cap[s]]
        assert table.live().tolist() == live
        assert table.any_live() == bool(live)
        assert table.held == sum(o >= 0 for o in owner)
        assert table.owned().tolist() == [s for s in range(batch) if owner[s] >= 0]
        owned = table.owned()
        assert table.gen(owned).tolist() == [gen[s] for s in owned]
        assert table.positions(owned).tolist() == [pos[s] for s in owned]
        if live:
            assert table.top_position() == max(pos[s] for s in live)
            assert table.crossing(bs).tolist() == [s for s in live if pos[s] % bs == 0]
            fewest = min(gen[s] for s in live)
            assert table.least_advanced(np.asarray(live)) == max(s for s in live if gen[s] == fewest)
            table.steps += 1
            for s in live:
                pos[s] += 1
                gen[s] += 1


def test_version_log_equals_per_step_stamps():
    """Change points give each response the version of the step that drew each of its tokens."""
    rng = random.Random(1)
    for _ in range(300):
        log, current, stamp = VersionLog(5), 5, {0: 5}
        for step in range(1, 30):
            if rng.random() < 0.25:
                current += rng.randint(1, 2)
            if rng.random() < 0.5:  # unchanged versions are also reported
                log.set(step, current)
            stamp[step] = log.current
        first = rng.randrange(30)
        n = rng.randint(1, 30 - first)
        assert log.tokens(first, n) == [stamp[first + t] for t in range(n)]
    log = VersionLog(0)
    log.set(0, 3)  # an update before the first prefill replaces the starting version
    assert log.tokens(0, 2) == [3, 3]


def test_to_device_copies_values():
    cpu = torch.device("cpu")
    assert to_device([3, 1, 2], cpu).tolist() == [3, 1, 2]
    assert to_device([0.5], cpu, torch.float32).dtype == torch.float32
    src = torch.arange(4)
    assert torch.equal(to_device(src, cpu), src)
