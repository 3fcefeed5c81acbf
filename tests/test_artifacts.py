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


def _dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_later_build_removes_what_killed_builds_left_and_nothing_else(tmp_path: Path) -> None:
    """What `kill -9` of a build leaves (a staging dir, the reference's temporary, a kept
    version's temporary, a metrics temporary) goes; a live process's temporaries and every real
    directory stay."""
    import os

    from pipeline.artifacts import Layout, sweep_leftovers

    layout = Layout(tmp_path / "artifacts", "m")
    dead, alive = _dead_pid(), os.getppid()
    leftovers = [
        layout.recipe_dir / f".staging-gguf-q8_0-{dead}",
        layout.recipe_dir / f".staging-old-gguf-q8_0-{dead}",
        layout.recipe_dir / f".reference.tmp-{dead}",
        layout.cache_dir / f"gguf-base-f16.tmp-{dead}",
        layout.versions_dir("gguf-q8_0") / f".tmp-{dead}",
    ]
    kept = [
        layout.recipe_dir / f".staging-gguf-q4_0-{alive}",
        layout.recipe_dir / "gguf-q8_0",
        layout.recipe_dir / ".reference",
        layout.versions_dir("gguf-q8_0") / "1",
    ]
    for d in leftovers + kept:
        d.mkdir(parents=True)
        (d / "weights.bin").write_bytes(b"x")
    (leftovers[-1] / "weights.bin").chmod(0o444)  # a kept version's files are read-only
    stray_file = layout.metrics_dir / f".gguf-q8_0.json.tmp-{dead}"
    stray_file.parent.mkdir(parents=True)
    stray_file.write_text("{")
    assert sorted(sweep_leftovers(layout)) == sorted([*leftovers, stray_file])
    assert not any(p.exists() for p in [*leftovers, stray_file])
    assert all((d / "weights.bin").is_file() for d in kept)
