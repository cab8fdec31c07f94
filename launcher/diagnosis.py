"""The launcher's diagnosis when a run fails: what failed first, its log's last lines, how to resume.

A failed run usually shows its cause long before its end: a worker stuck or crashed, restarted
until no restarts were left; a learner rank that died. The exit summary lists every process;
the diagnosis block names the *first* fault the supervisor saw (a process exiting with a
non-zero code, or found stuck), prints the last ``TAIL_LINES`` of that process's log, and the
command that resumes the run from its newest checkpoint. The exit codes of ``streamrl-launch``
are defined here (described in its ``--help`` and in docs/faults.md).
"""
from __future__ import annotations

import shlex
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

EXIT_OK = 0  # this host's part finished
EXIT_CONFIG = 2
"""A bad flag, config or placement: nothing started."""
EXIT_FAULT = 3
"""A fault the launcher gave up on (restarts used up, the learner failed, all workers failed, Redis lost)."""
# A stop on request exits 128 + the signal (the shell's convention): 130 after Ctrl-C, 143 after SIGTERM.
TAIL_LINES = 20


@dataclass(frozen=True)
class Fault:
    """One abnormal event of a supervised process (the supervisor records them in order)."""

    at: float
    """Wall time (``time.time()``)."""
    process: str
    what: str
    log: Path


def tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of ``path`` ([] when it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=lines)]
    except OSError:
        return []


def resume_command(argv: list[str] | None) -> str:
    """The command line that continues this run from its newest checkpoint."""
    return shlex.join(["streamrl-launch", *[a for a in (argv or []) if a != "--resume"], "--resume"])


def diagnosis(failures: list[str], faults: list[Fault], resume: str | None) -> str:
    """The block printed after the exit summary of a failed run."""
    lines = ["streamrl-launch: diagnosis", f"  the run failed: {failures[0]}"]
    if faults:
        first = faults[0]
        lines.append(f"  first fault: {first.process} {first.what} at "
                     f"{time.strftime('%H:%M:%S', time.localtime(first.at))}")
        lines.append(f"  last lines of {first.log}:")
        lines += [f"    | {line}" for line in tail(first.log)] or ["    (empty)"]
    lines.append(f"  resume: {resume}" if resume else "  no checkpoint yet: run the same command again")
    return "\n".join(lines)
