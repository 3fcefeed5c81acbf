"""The environment locks (envs/*.lock, `make lock`) agree with their inputs and hash every file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.environments import ENVIRONMENTS, locked_environments

ENVS = Path(__file__).resolve().parent.parent / "envs"
# the core's locks, then every tool environment of pipeline.environments' table
LOCKED = ("core", "testdata", "uv", *(env.name for env in locked_environments()))


def _pins(text: str) -> dict[str, str]:
    """name → version of every `name==version` line (names normalised as pip does)."""
    found = re.findall(r"^([A-Za-z0-9._-]+)==([^\s\\;]+)", text, flags=re.M)
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in found}


@pytest.mark.parametrize("name", LOCKED)
def test_every_pin_of_the_input_is_in_the_lock_and_every_entry_is_hashed(name: str) -> None:
    lock = (ENVS / f"{name}.lock").read_text()
    locked = _pins(lock)
    pinned = _pins((ENVS / f"{name}.txt").read_text())
    stale = {pkg: ver for pkg, ver in pinned.items() if locked.get(pkg) != ver}
    assert not stale, f"envs/{name}.txt pins {stale} but envs/{name}.lock does not: run `make lock`"
    entries = re.split(r"\n(?=[A-Za-z0-9])", lock.split("\n", 2)[2])
    unhashed = [e.split()[0] for e in entries if e.strip() and "--hash=sha256:" not in e]
    assert not unhashed, f"envs/{name}.lock has entries without hashes: {unhashed}"


def test_setup_and_lock_scripts_read_the_environment_table() -> None:
    """No hand-written list of environments in the scripts: they ask the table."""
    scripts = Path(__file__).resolve().parent.parent / "scripts"
    for script in ("setup.sh", "lock.sh"):
        text = (scripts / script).read_text()
        assert "-m pipeline.environments locked" in text, script
        for name in ENVIRONMENTS:
            assert f"envs/{name}." not in text, f"{script} names envs/{name} by hand"


def test_the_vllm_lock_leaves_out_the_cuda_builds_that_break_transformers_on_cpu() -> None:
    locked = _pins((ENVS / "vllm.lock").read_text())
    assert locked["torch"] == "2.13.0+cpu"
    assert not {"torchvision", "torchaudio", "torchcodec", "triton"} & set(locked)
