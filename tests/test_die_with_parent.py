"""Children of the launcher (and torchrun's ranks) die with their parent: no orphans after a SIGKILL."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from streamrl.utils import DIE_WITH_PARENT_ENV, die_with_parent, die_with_parent_if_launched

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux only")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _orphan_after_parent_sigkill(parent_code: str, tmp_path) -> tuple[int, bool]:
    """Run ``parent_code`` (it writes its child's pid to a file), SIGKILL it, see if the child goes."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", parent_code, str(pid_file), str(tmp_path / "child.log")],
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert time.monotonic() < deadline, "parent never started its child"
            assert parent.poll() is None, f"parent exited with {parent.returncode}"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        time.sleep(0.3)  # the child is past its preexec/startup
        assert _alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        return child, _wait_gone(child, 10)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_managed_process_child_dies_when_the_launcher_is_sigkilled(tmp_path):
    code = textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from streamrl.launcher.process import ManagedProcess
        p = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], Path(sys.argv[2]))
        p.start()
        Path(sys.argv[1]).write_text(str(p.pid))
        time.sleep(120)
    """)
    child, gone = _orphan_after_parent_sigkill(code, tmp_path)
    try:
        assert gone, "the launcher's child outlived the launcher"
    finally:
        if not gone:
            os.kill(child, signal.SIGKILL)


def test_without_the_request_the_orphan_survives(tmp_path):
    # The control: the same shape with a plain Popen in a new session keeps running, so the test
    # above measures die_with_parent and not some other way the child could go.
    code = textwrap.dedent("""
        import subprocess, sys, time
        from pathlib import Path
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        Path(sys.argv[1]).write_text(str(p.pid))
        time.sleep(120)
    """)
    child, gone = _orphan_after_parent_sigkill(code, tmp_path)
    try:
        assert not gone
    finally:
        os.kill(child, signal.SIGKILL)


def test_torchrun_rank_with_the_env_dies_with_its_agent(tmp_path):
    # torchrun puts ranks in their own sessions, so killing the agent's group misses them; the
    # learner entry point asks for SIGKILL on the agent's death when the launcher's env says so.
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        from pathlib import Path
        from streamrl.utils import die_with_parent_if_launched
        # what streamrl.workers.learner.main() calls first; the real learner under a real launcher is
        # tests/chaos/test_chaos.py::test_torchrun_agent_sigkilled_takes_its_rank_and_the_run_resumes
        die_with_parent_if_launched(signal.SIGKILL)
        Path({str(tmp_path / 'rank')!r} + os.environ["RANK"]).write_text(str(os.getpid()))
        time.sleep(120)
    """))
    code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        from pathlib import Path
        from streamrl.launcher.process import DIE_WITH_PARENT_ENV
        env = {{**os.environ, DIE_WITH_PARENT_ENV: "1"}}
        agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc-per-node=1", {str(script)!r}], env=env)
        rank = Path({str(tmp_path / 'rank0')!r})
        while not rank.exists() or not rank.read_text():
            time.sleep(0.05)
        Path(sys.argv[1]).write_text(str(agent.pid))
        Path(sys.argv[1] + ".rank").write_text(rank.read_text())
        time.sleep(120)
    """)
    # here the "parent" we SIGKILL is the torchrun agent itself, started by the code above
    pid_file = tmp_path / "agent.pid"
    holder = subprocess.Popen([sys.executable, "-c", code, str(pid_file)], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and (tmp_path / "agent.pid.rank").exists()):
            assert time.monotonic() < deadline and holder.poll() is None, "torchrun never started its rank"
            time.sleep(0.1)
        time.sleep(0.2)
        agent, rank = int(pid_file.read_text()), int((tmp_path / "agent.pid.rank").read_text())
        assert _alive(rank)
        os.kill(agent, signal.SIGKILL)
        assert _wait_gone(rank, 10), "the rank outlived its torchrun agent"
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(10)


def test_die_with_parent_request_is_accepted_and_gated_by_the_env(monkeypatch):
    # signal 0 clears the request, so asking leaves this test process as it was
    assert die_with_parent(0) is True
    monkeypatch.delenv(DIE_WITH_PARENT_ENV, raising=False)
    assert die_with_parent_if_launched(0) is False
    monkeypatch.setenv(DIE_WITH_PARENT_ENV, "1")
    assert die_with_parent_if_launched(0) is True



def test_a_child_started_from_a_short_lived_thread_is_not_tied_to_it(tmp_path):
    # The kernel ties the request to the forking *thread*: a Redis started from a Timer thread
    # (tests/chaos/test_units.py does that) must not die when the timer thread ends.
    import threading

    from streamrl.launcher.process import ManagedProcess

    p = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "log")
    t = threading.Thread(target=p.start)
    t.start()
    t.join()
    try:
        time.sleep(1.0)
        assert p.alive(), "the child died with the thread that started it"
    finally:
        p.stop(grace_s=1)
