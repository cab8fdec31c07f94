"""The launcher's live progress line: tails metrics.jsonl as the learner appends it."""
from __future__ import annotations

import io
import json

from streamrl.launcher.progress import Progress, progress_line


def row(step: int, reward: float, wall: float) -> dict:
    return {"learner/step": step, "learner/reward_mean": reward, "learner/samples": 256 * step,
            "learner/version": step, "wall_s": wall}


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_are_rate_limited_and_skip_partial_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    out = io.StringIO()
    p = Progress(path, total_steps=100, out=out, interval_s=10.0)
    assert p.poll(now=0.0) is None  # no file yet
    with open(path, "a") as f:
        f.write(json.dumps(row(1, 0.1, 1.0)) + "\n")
        f.write(json.dumps(row(2, 0.3, 2.0))[:20])  # the learner is mid-write
        f.flush()
        assert p.poll(now=0.0).startswith("step 1/100 (1%)  reward 0.100")
        f.write(json.dumps(row(2, 0.3, 2.0))[20:] + "\n")
        f.flush()
        assert p.poll(now=5.0) is None  # within the interval
        line = p.poll(now=10.0)
    assert line == "step 2/100 (2%)  reward 0.300 (avg10 0.200)  samples/s 256  version 2  ETA 1:38"
    assert p.poll(now=30.0) is None  # nothing new
    assert out.getvalue().splitlines() == [
        "streamrl-launch: step 1/100 (1%)  reward 0.100 (avg10 0.100)  samples/s 256  version 1  ETA 1:39",
        f"streamrl-launch: {line}"]


def test_tty_rewrites_one_line_and_finish_ends_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    out = FakeTTY()
    p = Progress(path, total_steps=10, out=out)
    assert p.tty
    with open(path, "a") as f:
        for step in range(1, 4):
            f.write(json.dumps(row(step, step / 10, float(step))) + "\n")
            f.flush()
            p.poll(now=float(step))
    p.finish()
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert text.rstrip().endswith("step 3/10 (30%)  reward 0.300 (avg10 0.200)  samples/s 256  version 3  ETA 0:07")


def test_line_without_optional_keys():
    assert progress_line({"learner/step": 5}, 10, []) == "step 5/10 (50%)"


def test_last_step_seconds_from_learner_rows_only(tmp_path):
    """The stop grace is sized from this: eval rows (no learner/step) in between do not count."""
    path = tmp_path / "metrics.jsonl"
    p = Progress(path, total_steps=10, out=io.StringIO(), tty=False)
    assert p.last_step_s() is None
    rows = [{"learner/step": 1, "wall_s": 40.0}, {"eval/accuracy": 0.2, "wall_s": 55.0},
            {"learner/step": 2, "wall_s": 95.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert p.last_step_s() == 55.5
