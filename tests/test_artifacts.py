"""The one cached-step helper: reuse by key, atomic replacement, no partial directory, one
computation when processes race for the same step."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from pipeline.artifacts import cached_step, read_key
from pipeline.constants import STEP_KEY_FILE


def _write(text: str, runs: Path | None = None, seconds: float = 0.0):
    def produce(tmp: Path) -> None:
        if runs is not None:
            with open(runs, "a") as fh:
                fh.write("run\n")
        time.sleep(seconds)
        (tmp / "out.txt").write_text(text)

    return produce


def test_reused_while_the_key_matches_and_replaced_when_it_changes(tmp_path: Path) -> None:
    step, lock, runs = tmp_path / "step", tmp_path / "step.lock", tmp_path / "runs"
    assert cached_step(step, "k1", _write("one", runs), lock) == step
    cached_step(step, "k1", _write("never", runs), lock)
    assert (step / "out.txt").read_text() == "one" and read_key(step) == "k1"
    cached_step(step, "k2", _write("two", runs), lock)
    assert (step / "out.txt").read_text() == "two" and runs.read_text().count("run") == 2
    assert (step / STEP_KEY_FILE).name.startswith(".")  # never part of a checkpoint's own hash


def test_a_failing_step_leaves_the_old_result_and_no_partial_directory(tmp_path: Path) -> None:
    step, lock = tmp_path / "step", tmp_path / "step.lock"
    cached_step(step, "k1", _write("one"), lock)

    def broken(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("converter crashed")

    with pytest.raises(RuntimeError, match="converter crashed"):
        cached_step(step, "k2", broken, lock)
    assert (step / "out.txt").read_text() == "one" and read_key(step) == "k1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step", "step.lock"]


def _race(step: str, lock: str, runs: str) -> None:
    cached_step(Path(step), "k", _write("done", Path(runs), seconds=1.0), Path(lock))


def test_processes_racing_for_one_step_compute_it_once(tmp_path: Path) -> None:
    args = (str(tmp_path / "step"), str(tmp_path / "step.lock"), str(tmp_path / "runs"))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_race, args=args) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert (tmp_path / "runs").read_text().count("run") == 1
    assert (tmp_path / "step" / "out.txt").read_text() == "done"
