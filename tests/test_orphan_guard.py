"""A child started through the orphan guard dies with its parent, even when the parent is SIGKILLed."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PARENT = """
import subprocess, sys, time
from launch.orphan_guard import guarded
child = subprocess.Popen([*guarded(), sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in state  # a zombie has exited; only its parent's reaping is left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_guarded_child_dies_when_its_parent_is_killed():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1]
    )
    child_pid = int(parent.stdout.readline())
    assert alive(child_pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    parent.stdout.close()
    # Polling another process's state is the only way to watch it; the deadline bounds it.
    deadline = time.monotonic() + 10
    while alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    still = alive(child_pid)
    if still:
        os.kill(child_pid, signal.SIGKILL)
    assert not still, "the child outlived its killed parent"


def test_guard_refuses_to_start_for_a_parent_that_is_gone():
    out = subprocess.run(
        [sys.executable, "-m", "launch.orphan_guard", "1", "--", "true"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    assert out.returncode != 0 and "parent 1 is gone" in out.stderr
