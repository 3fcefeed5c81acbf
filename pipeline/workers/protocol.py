"""The worker side of a step: read REQUEST.json, run one op, write RESULT.json (stdlib only: this
module is imported by the core and inside every tool environment)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

Op = Callable[[dict[str, Any]], dict[str, Any]]
LOCK_STAMP = ".pipeline-lock"  # in a venv's root: "envs/<name>.lock sha256:<hex>" (scripts/setup.sh)

# `python -c DIE_WITH_PARENT PARENT_PID PROGRAM ARGS...`: on Linux, ask the kernel to SIGKILL this
# process when its parent dies (PR_SET_PDEATHSIG = 1; kept across exec), give up if the parent is
# already gone, then become PROGRAM. Every step worker and every server a serve check starts runs
# under it, so none outlives the build that started it (a `kill -9` of the build included).
DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "if sys.platform.startswith('linux'): ctypes.CDLL(None, use_errno=True).prctl(1, 9)\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(70)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def dying_with_parent(argv: list[str], python: str = sys.executable) -> list[str]:
    """`argv` wrapped so that it dies with the process that starts it (DIE_WITH_PARENT)."""
    return [python, "-c", DIE_WITH_PARENT, str(os.getpid()), *argv]


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC/EDQUOT, or numpy's own messages (OSErrors without errno): its preallocation's and its
    short write's ("884736 requested and 476224 written")."""
    if not isinstance(exc, OSError):
        return False
    said = str(exc)
    return (
        exc.errno in (errno.ENOSPC, errno.EDQUOT)
        or "free space" in said
        or "No space left" in said
        or re.search(r"\d+ requested and \d+ written", said) is not None
    )


def installed_versions(*dists: str) -> dict[str, str]:
    """Versions of the named distributions installed in this environment (absent ones left out)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for dist in dists:
        with contextlib.suppress(PackageNotFoundError):
            found[dist] = version(dist)
    return found


def environment_lock() -> str | None:
    """The lock files this environment was installed from, with their sha256 (the stamp
    scripts/setup.sh writes into the venv), or None for an environment it did not make."""
    stamp = Path(sys.prefix) / LOCK_STAMP
    return stamp.read_text().strip() if stamp.is_file() else None


def group_rss_bytes(pgid: int) -> int:
    """Summed VmRSS of the processes in process group `pgid` (Linux /proc; 0 elsewhere)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # after "pid (comm)": state, ppid, pgrp
                continue
            for line in (stat.parent / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
    return total


def gpu_memory_used_mib(nvidia_smi: str) -> tuple[float, ...] | None:
    """Memory used on each GPU of the host, in nvidia-smi's index order (MiB), or None when
    nvidia-smi does not answer."""
    try:
        out = subprocess.run(
            [nvidia_smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
        return tuple(float(v) for v in out.split()) or None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class UsageSampler:
    """Samples a process group's summed RSS (from /proc), each GPU's used memory (nvidia-smi,
    device-wide; None without one) and the CPU time every other process of the host used (outside
    that group and the sampler's own), every interval_s in a thread while in use (`with`). Keeps
    every sample, so a caller can ask for a time window's peaks and contention (one load level)."""

    def __init__(self, pgid: int, interval_s: float = 0.5) -> None:
        self.pgid, self.interval_s = pgid, interval_s
        # (time.time(), rss bytes, MiB per GPU, other processes' CPU seconds since the first sample)
        self.samples: list[tuple[float, int, tuple[float, ...] | None, float]] = []
        self._nvidia_smi = shutil.which("nvidia-smi")
        self._mine = os.getpgrp()
        self._others: dict[int, int] = {}  # pid -> its CPU ticks when last seen
        self._others_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> UsageSampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            gpu = gpu_memory_used_mib(self._nvidia_smi) if self._nvidia_smi else None
            self._count_others()
            self.samples.append((time.time(), group_rss_bytes(self.pgid), gpu, self._others_s))
            if self._stop.wait(self.interval_s):
                return

    def _count_others(self) -> None:
        """Add the CPU time other processes used since the last call (a process first seen now
        counts whole, except at the first call). The sampled group's descendants in groups of
        their own (a server started in its own session) are the group's work, not others'."""
        procs: dict[int, tuple[int, int, int]] = {}  # pid -> (ppid, pgrp, CPU ticks)
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                # after "pid (comm)": state, ppid, pgrp, ...; utime, stime at 11, 12
                procs[int(stat.parent.name)] = (
                    int(fields[1]),
                    int(fields[2]),
                    int(fields[11]) + int(fields[12]),
                )
            except (OSError, IndexError, ValueError):
                continue  # the process ended while we looked
        ours: dict[int, bool] = {}  # in the sampled group, or started by one of its processes

        def is_ours(pid: int) -> bool:
            chain = []
            while pid in procs and pid not in ours and procs[pid][1] != self.pgid:
                chain.append(pid)
                pid = procs[pid][0]
            verdict = ours.get(pid, pid in procs)  # stopped at a group member, or at the top
            for p in chain:
                ours[p] = verdict
            return verdict

        seen = {pid: t for pid, (_, pgrp, t) in procs.items() if pgrp != self._mine and not is_ours(pid)}
        if self.samples:
            ticks = sum(max(0, t - self._others.get(pid, 0)) for pid, t in seen.items())
            self._others_s += ticks / os.sysconf("SC_CLK_TCK")
        self._others = seen

    def _inside(self, start: float, end: float) -> list[tuple[int, tuple[float, ...] | None]]:
        """(rss, MiB per GPU) of the samples between start and end, widened by one and a half
        intervals (a window may be shorter than one)."""
        slack = self.interval_s * 1.5
        return [(rss, gpu) for t, rss, gpu, _ in self.samples if start - slack <= t <= end + slack]

    def peaks(self, start: float = 0.0, end: float = float("inf")) -> tuple[int, float | None]:
        """Peak RSS (bytes) and peak GPU MiB, all GPUs summed, between start and end."""
        inside = self._inside(start, end)
        gpus = [sum(gpu) for _, gpu in inside if gpu is not None]
        return max((rss for rss, _ in inside), default=0), max(gpus) if gpus else None

    def peak_gpu_mib_each(self, start: float = 0.0, end: float = float("inf")) -> list[float] | None:
        """Each GPU's own peak MiB between start and end (a sharded engine's per-GPU need), in
        nvidia-smi's index order; None without a GPU or on one GPU (the sum says it)."""
        gpus = [gpu for _, gpu in self._inside(start, end) if gpu is not None]
        if not gpus or len(gpus[0]) < 2:
            return None
        return [max(sample[i] for sample in gpus if len(sample) > i) for i in range(len(gpus[0]))]

    def others_cpu_share(self, start: float = 0.0, end: float = float("inf")) -> float | None:
        """The share of the host's CPUs that other processes used between start and end (0: the
        host was ours; 1: every CPU busy with something else); None below two samples."""
        inside = [(t, cpu) for t, _, _, cpu in self.samples if start <= t <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        share = (inside[-1][1] - inside[0][1]) / ((inside[-1][0] - inside[0][0]) * cpus)
        return round(min(share, 1.0), 3)

    @property
    def peak_rss(self) -> int:
        return self.peaks()[0]

    @property
    def peak_gpu_mib(self) -> float | None:
        return self.peaks()[1]


ROOT_CAUSE_ABOVE = "See root cause above."  # vLLM's front end, when its engine core process failed


# llama.cpp's log lines: time, level, component; an error's becomes "llama.cpp error: <message>"
# ("0.00.002.969 E srv  start: couldn't bind ..."; the library's own have no component:
# "0.01.112.000 E llama_model_load: error loading model: ...")
LLAMA_ERROR = re.compile(r"^\d+(?:\.\d+){3} E (?:\w+\s+(?=\S+: ))?")
LLAMA_ERROR_MARK = "llama.cpp error: "
LLAMA_EXITING = "exiting due to"  # llama-server's last words after the error that made it stop


def exit_reason(server: subprocess.Popen[bytes], log: Path) -> str | None:
    """Why a server process stopped, the last error line of its log (last_error_line); None while it
    runs. Asked whenever a request to it fails: a dead server is the root cause, whatever the
    request said."""
    if server.poll() is None:
        return None
    return last_error_line(log.read_text(errors="replace"))


def last_error_line(output: str) -> str:
    """The line of a server's output that says why it stopped: the last `...Error: ...` (or
    uvicorn's `ERROR:`, llama.cpp's level-E) line, else the last non-empty one. Where that line only
    points at a root cause printed before it (vLLM's "Engine core initialization failed. See root
    cause above."), its head is joined with the last error line before it that is not such a
    pointer; llama-server's last words ("exiting due to model loading error") with its first
    error line, which says why."""
    prefix = re.compile(r"^(\x1b\[[0-9;]*m)*(\(\S+ pid=\d+\)\s*)?")  # colour codes, "(APIServer pid=N) "
    lines = [prefix.sub("", ln).strip() for ln in output.splitlines()]
    lines = [LLAMA_ERROR.sub(LLAMA_ERROR_MARK, ln) for ln in lines if ln]
    errors = [
        ln
        for ln in lines
        if ln.startswith(("ERROR:", LLAMA_ERROR_MARK))
        or re.match(r"^[\w.]*(Error|Exception)\b", ln.split("] ")[-1])
    ]
    line = (errors or lines or ["no output"])[-1]
    llama = [ln for ln in errors if ln.startswith(LLAMA_ERROR_MARK)]
    if line.startswith(LLAMA_ERROR_MARK) and LLAMA_EXITING in line and len(llama) > 1:
        line = f"{llama[0]}; {line.removeprefix(LLAMA_ERROR_MARK)}"  # the first: the cause
    causes = [ln for ln in errors if ROOT_CAUSE_ABOVE not in ln]
    if ROOT_CAUSE_ABOVE in line and causes:
        line = f"{line.split(ROOT_CAUSE_ABOVE)[0].strip()} {causes[-1]}"
    return line[:400]


def worker_main(ops: dict[str, Op]) -> None:
    """Entry point of a worker module: dispatch REQUEST.json's op, write RESULT.json."""
    req_path, res_path = Path(sys.argv[1]), Path(sys.argv[2])
    request = json.loads(req_path.read_text())
    op = request.get("op")
    try:
        if op not in ops:
            raise ValueError(f"unknown op {op!r} (known: {', '.join(ops)})")
        from pipeline.workers.requests import (
            check_reply,
            check_request,
        )  # pydantic: the core imports this module

        main = sys.modules["__main__"]
        worker = getattr(main.__spec__, "name", "") if main.__spec__ else ""
        check_request(worker, request)
        result = ops[op](request)
        lock = environment_lock()
        if lock and isinstance(result.get("toolchain"), dict):
            result["toolchain"]["lock"] = lock  # part of every target's inputs hash
        check_reply(worker, op, result)
    except Exception as exc:  # reported to the core as one line; the traceback goes to the log
        traceback.print_exc()
        message = (str(exc).splitlines() or [""])[0] or type(exc).__name__
        disk_full = is_disk_full(exc)
        if disk_full:
            message = f"no space left on device ({message})"
        result = {"error": message, "disk_full": disk_full}
    sys.stdout.flush()
    res_path.write_text(json.dumps(result))
