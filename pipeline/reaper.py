"""Ends what a `--cluster local` driver started once that driver is gone, even by `kill -9`.

Ray 2.60's DashboardAgent and RuntimeEnvAgent outlive a killed driver by about 75 s (they report
the dead raylet to the dead GCS with a fixed 60 s timeout), and a build task's step processes
would compute on. The driver marks the node it starts: `MARK` in the environment Ray's processes
inherit (GCS, raylet, agents, workers and the steps they start, also in sessions of their own).
A watcher in its own session polls the driver; when it has gone, the watcher SIGKILLs every
process carrying the mark's value, never a process found by name.

    python -m pipeline.reaper DRIVER_PID MARK_VALUE
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

MARK = "PIPELINE_LOCAL_CLUSTER"
POLL_S = 0.5


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat): tells a reused pid
    from the one watched. None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]


def marked(value: str) -> list[int]:
    """Pids of the live processes whose environment holds MARK=value (this one excluded)."""
    wanted = f"{MARK}={value}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if wanted in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def end_marked(value: str) -> int:
    """SIGKILL every process marked `value`; how many there were."""
    pids = marked(value)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def start_watcher(value: str) -> subprocess.Popen[bytes]:
    """Watch this process from a session of its own, unmarked (its own sweep spares it)."""
    env = {k: v for k, v in os.environ.items() if k != MARK}
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.reaper", str(os.getpid()), value],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def watch(driver: int, value: str) -> None:
    """Return once `driver` has gone and what it marked is ended."""
    started = _start_time(driver)
    while started is not None and _start_time(driver) == started:
        time.sleep(POLL_S)
    end_marked(value)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
