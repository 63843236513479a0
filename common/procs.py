"""A child process that dies with its parent: `subprocess.Popen(..., preexec_fn=lambda:
die_with_parent(os.getpid() of the parent))`, or called first thing in a forked child. Linux's
PR_SET_PDEATHSIG sends SIGKILL when the parent (the thread that started the child) ends, however it
ends; elsewhere only the check that the parent is still there remains."""
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, new_session: bool = False):
    """For a child between fork and exec (or a forked step): optionally lead a new session (its
    own process group), get SIGKILL when the parent dies, and exit at once if the parent (pid
    `parent`) is already gone."""
    if new_session:
        os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
