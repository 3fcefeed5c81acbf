"""Artifact layout, atomic publishing and manifests: artifacts/<recipe>/<target>/manifest.json."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.constants import (
    CACHE_DIRNAME,
    GPU_METRICS_DIRNAME,
    LOCKS_DIRNAME,
    LOGS_DIRNAME,
    MANIFEST_NAME,
    METRICS_DIRNAME,
    REFERENCE_DIRNAME,
    REPORT_DIRNAME,
    SOURCE_RECORD,
    STAGING_PREFIX,
)
from pipeline.errors import BuildError, DiskFullError, RegistryError
from pipeline.hashing import file_sha256


def artifacts_root() -> Path:
    """PIPELINE_ARTIFACTS, else ./artifacts."""
    return Path(os.environ.get("PIPELINE_ARTIFACTS", "artifacts"))


@dataclass(frozen=True)
class Layout:
    """Where one recipe's artifacts, caches, logs and staging dirs live."""

    root: Path
    recipe: str

    @property
    def recipe_dir(self) -> Path:
        return self.root / self.recipe

    @property
    def cache_dir(self) -> Path:
        return self.recipe_dir / CACHE_DIRNAME

    @property
    def logs_dir(self) -> Path:
        return self.recipe_dir / LOGS_DIRNAME

    @property
    def source_record(self) -> Path:
        return self.recipe_dir / SOURCE_RECORD

    @property
    def reference_dir(self) -> Path:
        return self.recipe_dir / REFERENCE_DIRNAME

    def metrics_path(self, target: str, gpu_host: bool = False) -> Path:
        """`dvc metrics` file of a target; GPU-host-only targets have their own directory."""
        return self.recipe_dir / (GPU_METRICS_DIRNAME if gpu_host else METRICS_DIRNAME) / f"{target}.json"

    @property
    def metrics_dir(self) -> Path:
        return self.recipe_dir / METRICS_DIRNAME

    @property
    def report_path(self) -> Path:
        return self.recipe_dir / REPORT_DIRNAME / "size-vs-ppl.json"

    def target_dir(self, target: str) -> Path:
        return self.recipe_dir / target

    def new_staging(self, target: str) -> Path:
        """A fresh, empty directory beside the target; renamed into place when complete."""
        staging = self.recipe_dir / f"{STAGING_PREFIX}{target}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        return staging


@contextmanager
def build_lock(layout: Layout, name: str, wait: bool = False) -> Iterator[None]:
    """Hold an exclusive lock on one target (or shared step) of a recipe while it is built.

    A second build of the same target (another `pipeline build`, a parallel `dvc repro`) fails
    at once with the holder's pid; with `wait`, it waits instead (shared steps: the reference).
    """
    path = layout.recipe_dir / LOCKS_DIRNAME / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            raise BuildError(
                f"{layout.recipe}/{name} is being built by another process ({holder}); "
                "wait for it to finish, then build again"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}")
        fh.flush()
        yield


def publish(staging: Path, final: Path) -> None:
    """Move a complete staging dir into place; an older artifact is replaced only at that moment."""
    old = final.with_name(f"{STAGING_PREFIX}old-{final.name}-{os.getpid()}")
    if final.exists():
        final.rename(old)
    try:
        staging.rename(final)
    except OSError:
        if old.exists():
            old.rename(final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def file_entries(directory: Path) -> list[dict[str, Any]]:
    """`files` of a manifest: every file but the manifest, with sha256 and size."""
    entries = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
        entries.append(
            {
                "path": path.relative_to(directory).as_posix(),
                "sha256": file_sha256(path),
                "bytes": path.stat().st_size,
            }
        )
    return entries


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    tmp = directory / f".{MANIFEST_NAME}.tmp"
    try:
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
        tmp.replace(directory / MANIFEST_NAME)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise DiskFullError(f"no space left on device writing {directory / MANIFEST_NAME}") from None
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON next to `path`, then rename over it: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise DiskFullError(f"no space left on device writing {path}") from None
        raise


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST_NAME
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RegistryError(f"no artifact at {directory} ({MANIFEST_NAME} missing)") from None
    except ValueError as exc:
        raise RegistryError(f"{path} is corrupted: {exc}") from None


def iter_artifacts(root: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every published artifact under root as (dir, manifest), skipping staging/cache dirs."""
    if not root.is_dir():
        return
    for recipe_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for target_dir in sorted(p for p in recipe_dir.iterdir() if p.is_dir()):
            if target_dir.name.startswith(".") or not (target_dir / MANIFEST_NAME).is_file():
                continue
            yield target_dir, read_manifest(target_dir)


def verify_files(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """Problems found re-hashing an artifact's files against its manifest (empty when intact)."""
    problems = []
    for entry in manifest.get("files", []):
        path = directory / entry["path"]
        if not path.is_file():
            problems.append(f"{entry['path']}: missing")
        elif path.stat().st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
            problems.append(f"{entry['path']}: checksum mismatch")
    return problems
