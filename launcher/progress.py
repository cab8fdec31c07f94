"""The launcher's one-line live progress: step, reward, samples/s, version, ETA.

Read from what the learner already writes: ``RUN_DIR/metrics.jsonl`` (one JSON row per
learner step, appended and flushed per step), tailed from the last offset read; a partly
written last line waits for the next poll. On a terminal the line is rewritten in place
(``\\r``) at most ``tty_interval_s``; otherwise (logs, CI, pipes) a plain line is printed at
most every ``interval_s``, so a log file gets a readable trace rather than a wall of updates.

    step 120/300 (40%)  reward 0.912 (avg10 0.887)  samples/s 880  version 120  ETA 0:53
"""
from __future__ import annotations

import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO


def format_eta(seconds: float) -> str:
    """``H:MM:SS`` or ``M:SS``.

    Examples:
        >>> format_eta(53.2), format_eta(3725)
        ('0:53', '1:02:05')
    """
    s = max(int(round(seconds)), 0)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def progress_line(row: dict, total_steps: int, recent_rewards: list[float]) -> str:
    """The display line for the newest metrics row (keys as the learner writes them).

    Examples:
        >>> progress_line({"learner/step": 30, "learner/reward_mean": 0.5, "learner/samples": 7680,
        ...                "wall_s": 10.0, "learner/version": 30}, 120, [0.4, 0.5])
        'step 30/120 (25%)  reward 0.500 (avg10 0.450)  samples/s 768  version 30  ETA 0:30'
    """
    step = int(row.get("learner/step", 0))
    wall = float(row.get("wall_s", 0.0))
    parts = [f"step {step}/{total_steps} ({100 * step // max(total_steps, 1)}%)"]
    if "learner/reward_mean" in row:
        avg = sum(recent_rewards) / len(recent_rewards) if recent_rewards else row["learner/reward_mean"]
        parts.append(f"reward {row['learner/reward_mean']:.3f} (avg10 {avg:.3f})")
    if wall > 0 and "learner/samples" in row:
        parts.append(f"samples/s {row['learner/samples'] / wall:.0f}")
    if "learner/version" in row:
        parts.append(f"version {int(row['learner/version'])}")
    if wall > 0 and step > 0:
        parts.append(f"ETA {format_eta(wall / step * (total_steps - step))}")
    return "  ".join(parts)


@dataclass
class Progress:
    """Tails ``metrics_path`` and shows the newest learner step on ``out``."""

    metrics_path: Path
    total_steps: int
    out: TextIO = field(default_factory=lambda: sys.stdout)
    tty: bool | None = None
    """Rewrite one line in place; None: ``out.isatty()``."""
    interval_s: float = 10.0
    """Plain mode: at most one line per this many seconds (and only when a new step arrived)."""
    tty_interval_s: float = 0.5
    _offset: int = 0
    _pending: bytes = b""
    _row: dict | None = None
    _rewards: deque = field(default_factory=lambda: deque(maxlen=10))
    _shown_step: int = -1
    _last_show: float = float("-inf")
    _width: int = 0
    _walls: deque = field(default_factory=lambda: deque(maxlen=2))

    def __post_init__(self):
        if self.tty is None:
            self.tty = bool(getattr(self.out, "isatty", lambda: False)())

    def _read(self) -> None:
        try:
            with open(self.metrics_path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        self._offset += len(chunk)
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()  # an unfinished last line waits for the next read
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "learner/step" in row:
                self._row = row
                if "wall_s" in row:
                    self._walls.append(float(row["wall_s"]))
                if "learner/reward_mean" in row:
                    self._rewards.append(float(row["learner/reward_mean"]))

    def last_step_s(self) -> float | None:
        """Seconds between the learner's last two steps as of the last read (None before two)."""
        self._read()
        return self._walls[1] - self._walls[0] if len(self._walls) == 2 else None

    def poll(self, now: float | None = None) -> str | None:
        """Read new rows; show a line if one is due. Returns the line shown (None if none)."""
        now = time.monotonic() if now is None else now
        self._read()
        if self._row is None or int(self._row["learner/step"]) == self._shown_step:
            return None
        if now - self._last_show < (self.tty_interval_s if self.tty else self.interval_s):
            return None
        line = progress_line(self._row, self.total_steps, list(self._rewards))
        self._shown_step, self._last_show = int(self._row["learner/step"]), now
        if self.tty:
            self.out.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self.out.write(f"streamrl-launch: {line}\n")
        self.out.flush()
        return line

    def finish(self) -> None:
        """Show the newest step (if not shown yet) and end the in-place line."""
        self._last_show = float("-inf")
        self.poll()
        if self.tty and self._width:
            self.out.write("\n")
            self.out.flush()
            self._width = 0
