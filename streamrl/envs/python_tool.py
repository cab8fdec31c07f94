"""A Python tool: each call runs the model's code in a fresh, resource-limited subprocess.

Why not torchrl's ``PythonExecutorService``/``PythonInterpreter``: they keep persistent
interpreters shared round-robin across episodes (one episode's imports, monkey-patches and
``sys`` changes leak into the next episode's calls), apply no resource limits, and measure
their time limit by counting 10 ms sleeps (which runs long on a loaded host). A fresh
``python -I -S`` per call costs tens of milliseconds, starts from a clean state every time, and
the kernel enforces the limits (CPU seconds, address space, file size, open files); on a
timeout the child is killed, so the runner's thread is freed, unlike a hung in-process tool.
Not a sandbox against a determined attacker (network and the file system stay reachable):
run rollout workers that execute model code in a container.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

MAX_OUTPUT_CHARS = 2000  # what the model reads back; the rest is cut (and says so)


class PythonTool:
    """A torchrl ``ToolService``: ``python(code="print(6*7)") -> {"stdout": "42\\n", "stderr": "", "returncode": 0}``.

    timeout_s: wall-clock limit per call (the child is killed after it); also its CPU-time limit.
    memory_mb: address-space limit of the child.
    """

    name = "python"
    schema_in = {"code": str}
    schema_out = {"stdout": str, "stderr": str, "returncode": int}
    description = "Run a Python program and return what it prints."

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 1024):
        if timeout_s <= 0:
            raise ValueError(f"PythonTool timeout_s = {timeout_s}: must be > 0")
        if memory_mb < 64:
            raise ValueError(f"PythonTool memory_mb = {memory_mb}: must be >= 64")
        self.timeout_s, self.memory_mb = timeout_s, memory_mb

    def __call__(self, code: str, **_) -> dict:
        if not isinstance(code, str):
            raise ValueError(f"python tool: code must be a string, got {type(code).__name__}")
        with tempfile.TemporaryDirectory(prefix="streamrl-py-") as cwd:
            try:
                done = subprocess.run([sys.executable, "-I", "-S", "-c", _PRELUDE, code, str(self._cpu_s()),
                                       str(self.memory_mb << 20)], cwd=cwd, capture_output=True, text=True,
                                      timeout=self.timeout_s, env={"PATH": os.environ.get("PATH", "")})
            except subprocess.TimeoutExpired as e:  # subprocess.run has killed the child
                return {"stdout": _cut(e.stdout), "stderr": f"timed out after {self.timeout_s:g} s", "returncode": -9}
        return {"stdout": _cut(done.stdout), "stderr": _cut(done.stderr), "returncode": done.returncode}


    def _cpu_s(self) -> int:
        return max(1, int(self.timeout_s + 1))


# The child limits itself before it compiles the model's code: the limits are set in the child
# without ``preexec_fn``, which is unsafe in a process with threads (the runner's pool).
_PRELUDE = """
import resource, sys
_cpu, _mem = int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu))
resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
_src = sys.argv[1]
sys.argv = ["<python-tool>"]
del resource, _cpu, _mem
exec(compile(_src, "<python-tool>", "exec"), {"__name__": "__main__"})
"""


def _cut(text) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    text = text or ""
    return text if len(text) <= MAX_OUTPUT_CHARS else text[:MAX_OUTPUT_CHARS] + f"... [{len(text)} chars]"
