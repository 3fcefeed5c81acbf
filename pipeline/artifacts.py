"""Artifact layout (artifacts/<recipe>/<target>/), build locks, atomic publishing, and the one
cached-step helper every shared step uses."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
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
    STEP_KEY_FILE,
    VERSIONS_DIRNAME,
)
from pipeline.errors import BuildError, DiskFullError
from pipeline.hashing import file_sha256
from pipeline.locks import holding
from pipeline.manifest import FileEntry, Manifest, read_manifest
from pipeline.workers.protocol import is_disk_full


def artifacts_root() -> Path:
    """PIPELINE_ARTIFACTS, else ./artifacts."""
    return Path(os.environ.get("PIPELINE_ARTIFACTS", "artifacts"))


def cache_root() -> Path:
    """Where materialised sources and hash memos live (PIPELINE_CACHE, else ~/.cache/pipeline)."""
    return Path(os.environ.get("PIPELINE_CACHE", Path.home() / ".cache" / "pipeline"))


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

    def lock_path(self, name: str) -> Path:
        """The lock file of one target or shared step of this recipe."""
        return self.recipe_dir / LOCKS_DIRNAME / f"{name}.lock"

    def target_dir(self, target: str) -> Path:
        return self.recipe_dir / target

    def versions_dir(self, target: str) -> Path:
        return self.recipe_dir / VERSIONS_DIRNAME / target

    def new_staging(self, target: str) -> Path:
        """A fresh, empty directory beside the target; renamed into place when complete."""
        staging = self.recipe_dir / f"{STAGING_PREFIX}{target}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        return staging


def build_lock(layout: Layout, name: str) -> AbstractContextManager[None]:
    """Hold an exclusive lock on one target of a recipe while it is built.

    A second build of the same target (another `pipeline build`, a parallel `dvc repro`) fails
    at once with the holder's pid (shared steps wait instead: cached_step).
    """

    def refuse(holder: str) -> None:
        raise BuildError(
            f"{layout.recipe}/{name} is being built by another process ({holder or 'unknown'}); "
            "wait for it to finish, then build again"
        )

    return holding(layout.lock_path(name), f"pid {os.getpid()}", refuse)


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


# Names of the temporaries a process makes and renames when done: staging dirs
# (.staging-<target>-<pid>, .staging-old-<target>-<pid>) and `<name>.tmp-<pid>` (cached steps,
# kept versions, atomic writes). A build killed outright (SIGKILL, power) leaves them behind.
_LEFTOVER = re.compile(rf"^(?:{re.escape(STAGING_PREFIX)}.+-|.*\.tmp-)(\d+)$")


def sweep_leftovers(layout: Layout) -> list[Path]:
    """Delete the temporaries of processes that no longer run, under one recipe's directory (its
    top, its cache, its metrics and its versions); a live process's are left alone. Returns them."""
    recipe_dir = layout.recipe_dir
    places = [recipe_dir, layout.cache_dir, layout.metrics_dir, recipe_dir / VERSIONS_DIRNAME]
    if (recipe_dir / VERSIONS_DIRNAME).is_dir():
        places += [p for p in (recipe_dir / VERSIONS_DIRNAME).iterdir() if p.is_dir()]
    removed = []
    for place in places:
        if not place.is_dir():
            continue
        for path in place.iterdir():
            match = _LEFTOVER.match(path.name)
            if match is None or _running(int(match.group(1))):
                continue
            remove_path(path)
            removed.append(path)
    return removed


def remove_path(path: Path) -> None:
    """Delete a file, link or directory tree if it is there (a directory's read-only files go too:
    the directory is writable)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def versions_dir_of(artifact_dir: Path) -> Path:
    """Where the versions of the target whose workspace directory is `artifact_dir` are kept."""
    return artifact_dir.parent / VERSIONS_DIRNAME / artifact_dir.name


def version_numbers(versions_dir: Path) -> list[int]:
    """The versions kept under a target's versions directory, ascending."""
    if not versions_dir.is_dir():
        return []
    return sorted(int(p.name) for p in versions_dir.iterdir() if p.name.isdigit() and p.is_dir())


FICLONE = 0x40049409  # Linux ioctl: share the source's extents copy-on-write (btrfs, XFS, bcachefs)


def clone_file(src: Path, dst: Path) -> None:
    """A copy of `src` that shares no writable storage with it: a reflink where the filesystem
    has them (no bytes copied), else a plain copy. (A hard link would share the inode: an in-place
    write into the workspace, which root can make into a 0444 file, would change the version.)"""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
        except OSError:
            shutil.copyfileobj(fin, fout, 16 << 20)
    shutil.copystat(src, dst)


def keep_version(artifact_dir: Path, versions_dir: Path) -> tuple[int, Path]:
    """Record a complete artifact directory as the next version of its target: its files cloned
    (reflinked or copied: clone_file) into `versions_dir/<N>/`, read-only, made under a temporary
    name and renamed into place, so a version is complete or absent. Returns (N, its directory)."""
    versions_dir.mkdir(parents=True, exist_ok=True)
    tmp = versions_dir / f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for src in sorted(artifact_dir.rglob("*")):
            dst = tmp / src.relative_to(artifact_dir)
            if src.is_dir():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            clone_file(src, dst)
            dst.chmod(0o444)  # nothing may rewrite a version in place (pipeline never does)
        while True:
            number = max(version_numbers(versions_dir), default=0) + 1
            final = versions_dir / str(number)
            try:
                tmp.rename(final)  # fails if another process took this number first
                return number, final
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def file_entries(directory: Path) -> list[FileEntry]:
    """`files` of a manifest: every file but the manifest, with sha256 and size."""
    return [
        FileEntry(path=p.relative_to(directory).as_posix(), sha256=file_sha256(p), bytes=p.stat().st_size)
        for p in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    ]


def write_text_atomic(path: Path, text: str) -> None:
    """Write next to `path`, then rename over it: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise DiskFullError(f"no space left on device writing {path}") from None
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def iter_artifacts(root: Path) -> Iterator[tuple[Path, Manifest]]:
    """Every published artifact under root as (dir, manifest), skipping staging/cache dirs."""
    if not root.is_dir():
        return
    for recipe_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for target_dir in sorted(p for p in recipe_dir.iterdir() if p.is_dir()):
            if target_dir.name.startswith(".") or not (target_dir / MANIFEST_NAME).is_file():
                continue
            yield target_dir, read_manifest(target_dir)


def verify_files(directory: Path, files: list[FileEntry]) -> list[str]:
    """Problems found re-hashing an artifact's files against its manifest (empty when intact)."""
    problems = []
    root = directory.resolve()
    for entry in files:
        parts = PurePosixPath(entry.path).parts
        if not parts or entry.path.startswith("/") or ".." in parts:
            problems.append(f"{entry.path}: not a path inside the artifact directory")
            continue
        path = directory / entry.path
        if path.is_symlink() or (path.exists() and not path.resolve().is_relative_to(root)):
            problems.append(f"{entry.path}: a symbolic link (an artifact holds plain files only)")
        elif not path.is_file():
            problems.append(f"{entry.path}: missing")
        elif path.stat().st_size != entry.bytes or file_sha256(path) != entry.sha256:
            problems.append(f"{entry.path}: checksum mismatch")
    return problems


def read_key(directory: Path) -> str | None:
    """The inputs hash a cached step's directory was computed from (None: not there)."""
    try:
        return (directory / STEP_KEY_FILE).read_text()
    except OSError:
        return None


def cached_step(
    path: Path,
    key: str,
    produce: Callable[[Path], None],
    lock: Path,
    reusable: Callable[[Path], bool] | None = None,
) -> Path:
    """The one cache of every shared step (source materialising, reference, F16 base, imatrix, the
    vLLM reference, TensorRT-LLM checkpoints): `path` is a directory computed from inputs hashed to
    `key`. Reused while its recorded key matches (and `reusable(path)` agrees, asked under the
    lock); otherwise `produce(tmp)` fills a fresh sibling directory, which replaces `path` only
    once complete. A failure leaves no partial directory. Processes computing the same step wait
    for each other on `lock`."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        if read_key(path) == key and (reusable is None or reusable(path)):
            return path
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            produce(tmp)
            (tmp / STEP_KEY_FILE).write_text(key)
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if is_disk_full(exc):
                raise DiskFullError(f"no space left on device writing {path}") from None
            raise
    return path
