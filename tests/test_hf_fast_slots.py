"""Host bookkeeping of the fast engine's decode loop: step-counter slot table, version change points,
pinned host-to-device copies. Checked against the per-slot counters they replace."""
from __future__ import annotations

import random

import numpy as np
import pytest
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv", ["static", "paged"])
def test_gpu_decode_steps_between_syncs_never_wait_for_the_device(monkeypatch, kv):
    """Outside the loop's syncs (done read, harvest, refill) no step waits for the GPU: torch's sync
    debug mode raises on any synchronizing call there. Paged blocks of 4 positions make the loop edit
    block tables between replays."""
    from streamrl.config import ModelConfig
    from streamrl.engines.decode_loop import DecodeLoop
    from streamrl.engines.hf_fast import FastHFEngine
    from streamrl.engines.hf_fast_config import FastHFConfig
    from streamrl.models import build_model

    model, tok = build_model(ModelConfig(), seed=1)
    eng = FastHFEngine(model, tok, FastHFConfig(device="cuda", batch_size=4, max_seq_len=48, span_bucket=16,
                                                sync_every=8,
                       kv_cache=kv, block_size=4, eos_token_id=model.config.vocab_size))  # no EOS: fixed spans
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (3, 5, 7, 9, 4, 6)]
    eng.generate(prompts, 30, 1.0)  # captures every span's graph (capturing syncs)

    def allowed(fn):
        def run(self, *a):
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("default")
            try:
                return fn(self, *a)
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        return run

    monkeypatch.setattr(DecodeLoop, "_sync", allowed(DecodeLoop._sync))
    monkeypatch.setattr(DecodeLoop, "_fill", allowed(DecodeLoop._fill))
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = eng.generate(prompts, 30, 1.0, between_steps=lambda: None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert eng.captures and all(len(t) == 30 for t in out.tokens)
    assert [len(v) for v in out.versions] == [len(t) for t in out.tokens]
