"""The GPU host's kit (benchmarks/gpu/run_h200.sh) ends what it started by the mark its processes
carry in their environment, never by a name pattern: a stranger's process of the same name lives."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

KIT = REPO / "benchmarks" / "gpu" / "run_h200.sh"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def test_the_kit_ends_an_earlier_calls_processes_and_no_others(tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if k != "PIPELINE_KIT_RUN"}
    # an earlier call's worker, and the engine it started in a session of its own
    pidfile = tmp_path / "engine.pid"
    worker = subprocess.Popen(
        ["bash", "-c", f"setsid sleep 301 & echo $! > {pidfile}; wait"],
        env={**clean, "PIPELINE_KIT_RUN": "1-earlier"},
        start_new_session=True,
    )
    stranger = subprocess.Popen(["sleep", "301"], env=clean)  # same name, not the kit's
    deadline = time.monotonic() + 10
    while not pidfile.is_file() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    engine = int(pidfile.read_text())
    try:
        res = subprocess.run(["bash", str(KIT), "end-earlier"], env=clean, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        assert worker.wait(timeout=10) == -9
        deadline = time.monotonic() + 10
        while _alive(engine):
            assert time.monotonic() < deadline, "the engine in its own session outlived the kit's end"
            time.sleep(0.05)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_each_xdist_worker_takes_its_own_gpu_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_h200.sh tests` on a host with several GPUs: worker gwK sees GPU K alone."""
    from tests import conftest

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.delenv("PIPELINE_TEST_GPU_PER_WORKER", raising=False)
    conftest.pytest_configure(None)  # type: ignore[arg-type]  # the hook reads no config
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # make test's CPU workers are left alone
    monkeypatch.setenv("PIPELINE_TEST_GPU_PER_WORKER", "1")
    conftest.pytest_configure(None)  # type: ignore[arg-type]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
