"""`python -m launch.orphan_guard PARENT_PID -- COMMAND...`: run COMMAND so that it dies with PARENT_PID.

Engines and routers are started as child processes of the controller. If the controller is killed
hard (SIGKILL, OOM), nothing would stop them: they would hold their ports and GPU memory until
someone notices. On Linux the kernel's parent-death signal fixes that with no polling: this
guard asks for SIGTERM on the parent's death, checks that the parent is still there (it may have
died while we started), and then replaces itself with COMMAND, which keeps the setting. Elsewhere
it simply runs COMMAND.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m launch.orphan_guard PARENT_PID -- COMMAND...")
    parent, command = int(argv[0]), argv[2:]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        sys.exit(f"orphan_guard: parent {parent} is gone; not starting {command[0]}")
    os.execvp(command[0], command)


def guarded() -> list[str]:
    """The command prefix that ties a child process's life to this process."""
    return [sys.executable, "-m", "launch.orphan_guard", str(os.getpid()), "--"]


if __name__ == "__main__":
    main(sys.argv[1:])
