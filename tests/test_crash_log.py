"""A child of the launcher that crashes in native code leaves its Python stack in its log."""
from __future__ import annotations

import sys

from streamrl.launcher.plan import BASE_ENV
from streamrl.launcher.process import ManagedProcess

SEGFAULT = """
import ctypes

def read_address_zero():
    return ctypes.string_at(0)

read_address_zero()
"""


def test_segfaulting_child_writes_its_python_stack_into_its_log(tmp_path):
    log = tmp_path / "child.log"
    child = ManagedProcess("crasher", [sys.executable, "-c", SEGFAULT], log, env=dict(BASE_ENV))
    child.start()
    rc = child.proc.wait(timeout=60)
    text = log.read_text()
    assert rc == -11, (rc, text)
    assert "Fatal Python error: Segmentation fault" in text, text
    assert "read_address_zero" in text, text  # the frame that crashed, by name
