"""``streamrl-bench e2e --repeats``: medians, min-max spreads and per-pair ratios of run figures."""
from __future__ import annotations

import argparse
import json

import pytest

from streamrl.bench.e2e import parse_args, summarize, sync_batch


def _run(name: str, samples_per_s: float, idle_frac: float, steps: int = 4) -> dict:
    """A run as :func:`streamrl.bench.e2e.run_once` returns it: ``steps`` records of 1 s each."""
    records = [{"wall_s": float(i + 1), "learner/samples": samples_per_s * (i + 1), "learner/trained_tokens": 10,
                "learner/idle_s": idle_frac, "learner/step_s": 1.0 - idle_frac, "learner/reward_mean": 0.1 * i,
                "learner/staleness_mean": 0.0} for i in range(steps)]
    summary = {"transport": {}, "reward_first": 0.0, "samples_dropped_stale": 0}
    return {"name": name, "records": records, "summary": summary, "launch_wall_s": 5.0}


def test_repeats_give_medians_and_spreads(tmp_path):
    args = argparse.Namespace(target=None, staleness=4, learners=1, rollers=1, steps=4, config="c.yaml")
    pairs = [(_run("sync-0", 10, 0.5), _run("async-0", 18, 0.1)),
             (_run("sync-1", 12, 0.7), _run("async-1", 30, 0.2)),
             (_run("sync-2", 11, 0.6), _run("async-2", 20, 0.3))]
    res = summarize(args, pairs, tmp_path / "p.png")
    assert res["repeats"] == 3
    assert res["sync"]["samples_per_s"] == pytest.approx(11) and res["async"]["samples_per_s"] == pytest.approx(20)
    assert res["speedup_async_vs_sync"] == pytest.approx(20 / 11)
    assert res["spread"]["speedup_async_vs_sync"] == pytest.approx([1.8, 2.5])  # per-pair ratios
    assert res["spread"]["samples_per_s_sync"] == pytest.approx([10, 12])
    assert res["spread"]["learner_idle_pct_async"] == pytest.approx([10, 30])
    assert res["async"]["learner_idle_pct"] == pytest.approx(20)
    assert [r["speedup_async_vs_sync"] for r in res["runs"]] == pytest.approx([1.8, 2.5, 20 / 11])
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_repeats_default_three():
    assert parse_args([]).repeats == 3 and parse_args(["--repeats", "1"]).repeats == 1


def test_steady_state_leaves_out_the_start_up(tmp_path):
    """A 10 s first step (compile, graph capture) then 1 s steps: the steady figure sees only the latter."""
    args = argparse.Namespace(target=None, staleness=4, learners=1, rollers=1, steps=10, config="c.yaml")
    runs = []
    for name, per_step in (("sync", 8), ("async", 16)):
        run = _run(name, per_step, 0.5, steps=10)
        for i, rec in enumerate(run["records"]):
            rec["wall_s"] = 10.0 + i  # the first step ends at 10 s, then one step per second
        run["records"][0]["learner/idle_s"] = 9.5
        runs.append(run)
    res = summarize(args, [tuple(runs)], tmp_path / "p.png")
    assert res["sync"]["samples_per_s_steady"] == pytest.approx(8)  # steps 3..10 after the first fifth
    assert res["sync"]["samples_per_s"] == pytest.approx(80 / 19)
    assert res["speedup_async_vs_sync_steady"] == pytest.approx(2)
    assert res["async"]["learner_idle_pct_steady"] == pytest.approx(50)
    assert res["async"]["first_step_done_s"] == 10.0  # the start-up the whole-run figures carry


def test_learner_warm_up_counts_as_busy(tmp_path):
    """The learner's warm-up (compiles before the first batch, ``learner/warmup_s``) is work:
    the whole-run idle share counts it with the steps, not with the waits."""
    args = argparse.Namespace(target=None, staleness=4, learners=1, rollers=1, steps=4, config="c.yaml")
    sync, run = _run("sync", 8, 0.5), _run("async", 16, 0.5)
    run["records"][0]["learner/warmup_s"] = 6.0  # 4 x 0.5 s idle against 4 x 0.5 s steps + 6 s warm-up
    res = summarize(args, [(sync, run)], tmp_path / "p.png")
    assert res["async"]["learner_idle_pct"] == pytest.approx(100 * 2 / 10)
    assert res["sync"]["learner_idle_pct"] == pytest.approx(50)


@pytest.mark.parametrize("batch, per_step, rollers, want", [
    (8, 8, 1, 8), (4, 8, 2, 4), (32, 8, 1, 8), (32, 8, 2, 4), (32, 6, 4, 6), (3, 8, 1, 8)])
def test_sync_run_generates_one_step_at_a_time(batch, per_step, rollers, want):
    assert sync_batch(batch, per_step, rollers) == want


def test_merge_combines_the_pairs_of_several_results(tmp_path):
    """Pairs run in separate invocations (one per device call) merge into medians over all of them."""
    from streamrl.bench.e2e import main, merge

    args = argparse.Namespace(target=None, staleness=4, learners=1, rollers=1, steps=4, config="c.yaml")
    one = summarize(args, [(_run("sync-0", 10, 0.5), _run("async-0", 18, 0.1))], tmp_path / "a.png")
    two = summarize(args, [(_run("sync-0", 12, 0.7), _run("async-0", 30, 0.2)),
                           (_run("sync-1", 11, 0.6), _run("async-1", 20, 0.3))], tmp_path / "b.png")
    res = merge([one, two])
    assert res["repeats"] == 3
    assert res["speedup_async_vs_sync"] == pytest.approx(20 / 11)
    assert res["spread"]["speedup_async_vs_sync"] == pytest.approx([1.8, 2.5])
    assert res["spread"]["learner_idle_pct_async"] == pytest.approx([10, 30])
    assert [r["launch_wall_s"] for r in res["runs"]] == [[5.0, 5.0]] * 3
    files = []
    for i, r in enumerate((one, two)):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(r))
    assert main(["--merge", *map(str, files), "--out", str(tmp_path / "m")]) == 0
    assert json.loads((tmp_path / "m" / "result.json").read_text())["repeats"] == 3
    other = dict(two, steps=8)
    with pytest.raises(ValueError, match="steps = 8"):
        merge([one, other])
