"""Ends what a `--cluster local` driver started once that driver is gone, even by `kill -9`.

Ray 2.60's DashboardAgent and RuntimeEnvAgent outlive a killed driver by about 75 s (they report
the dead raylet to the dead GCS with a fixed 60 s timeout), and a build task's step processes
would compute on. The driver marks the node it starts: `MARK` in the environment Ray's processes
inherit (GCS, raylet, agents, workers and the steps they start, also in sessions of their own).
A watcher in its own session polls the driver; when it has gone, the watcher SIGKILLs every
process carrying the mark's value, never a process found by name.

    python -m pipeline.reaper DRIVER_PID DRIVER_START_TIME MARK_VALUE
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MARK = "PIPELINE_LOCAL_CLUSTER"
POLL_S = 0.5
SWEEPS = 20  # a marked process may fork while it is being ended: sweep again until none is left


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
    """SIGKILL every process marked `value`, sweeping again while any is left (one forked between
    a sweep's look and its kill) up to SWEEPS times; how many were ended."""
    ended = 0
    for _ in range(SWEEPS):
        pids = marked(value)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        ended += len(pids)
        time.sleep(0.05)
    return ended


@dataclass
class Watched:
    """A mark this process gave the processes it starts, and the watcher that ends them."""

    value: str
    watcher: subprocess.Popen[bytes]

    def end(self) -> None:
        """End the marked processes now (this process goes on) and the watcher with them."""
        end_marked(self.value)
        self.watcher.kill()
        self.watcher.wait()


def watch_this_process(value: str) -> Watched:
    """Start a watcher of this process in a session of its own, unmarked (its sweeps spare it);
    it is told this process's start time, so a pid reused before it looks is never mistaken."""
    env = {k: v for k, v in os.environ.items() if k != MARK}
    started = _start_time(os.getpid()) or ""
    watcher = subprocess.Popen(
        [sys.executable, "-m", "pipeline.reaper", str(os.getpid()), started, value],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return Watched(value, watcher)


def watch(driver: int, started: str, value: str) -> None:
    """Return once the process `driver` started at `started` has gone, and what it marked is ended."""
    while _start_time(driver) == started:
        time.sleep(POLL_S)
    end_marked(value)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2], sys.argv[3])
