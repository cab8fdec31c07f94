"""tools/gpu/reasoning_profile.py, dry run on CPU: the same code as the GPU call on a tiny
SmolLM2-shaped folder, and the loop breakdown of a metrics.jsonl."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "gpu"))
import reasoning_profile as rp  # noqa: E402


def test_lengths_hold_the_truncated_share():
    lens = rp.response_lengths(128, 1024, 72, 0.085)
    assert len(lens) == 128 and sum(x == 1024 for x in lens) == 11
    assert max(x for x in lens if x < 1024) < 1024 and min(lens) >= 2


@pytest.mark.timeout(180)
def test_tiny_cpu_run(capsys):
    assert rp.main(["--tiny", "--device", "cpu", "--dtypes", "float32", "--steps", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["float32"]
    d, lrn = r["decode"], r["learner"]
    # one worker batch lasts as long as its longest sample: the cut one (cap 48; the first token comes from
    # the prefill), whatever the others need
    assert d["slots"] == 16 and d["mix"]["decode_steps"] == 47 and d["mix"]["longest"] == 48
    assert d["no_tail"]["decode_steps"] < d["mix"]["decode_steps"]
    assert d["mix"]["slot_occupancy"] < 0.5
    # the learner packs: no row padded to the longest response
    assert lrn["samples"] == 8 and lrn["packed_tokens"] < lrn["padded_tokens"]
    assert 0 < lrn["optimizer_s"] < lrn["compute_s"] and lrn["publish_bytes"] > 0
    assert set(r["per_step_estimate_s"]) == {"rollout_bound_step_s", "rollout_bound_step_s_no_tail",
                                             "learner_compute_s"}


def test_loop_breakdown(tmp_path, capsys):
    rows = [{"wall_s": 30.0, "learner/idle_s": 25.0, "learner/step_s": 1.0, "learner/compute_s": 0.6,
             "weights/publish_s": 0.2, "learner/warmup_s": 7.0}]
    for i in range(1, 5):
        rows.append({"wall_s": 30.0 + 11 * i, "learner/idle_s": 10.0, "learner/step_s": 0.8,
                     "learner/compute_s": 0.5, "weights/publish_s": 0.2, "learner/response_len_mean": 160.0})
    out = rp.loop_breakdown(rows)
    assert out["wall_per_step_s"] == pytest.approx(11.0) and out["idle_s"] == 10.0
    assert out["other_s"] == pytest.approx(0.2) and out["step_rest_s"] == pytest.approx(0.1)
    assert out["first_step_warmup_s"] == 7.0 and out["idle_frac"] == pytest.approx(10 / 10.8)
    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert rp.main(["--loop-metrics", str(f)]) == 0
    assert "loop breakdown" in capsys.readouterr().out
