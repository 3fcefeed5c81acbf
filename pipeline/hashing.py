"""sha256 of files and checkpoint directories, memoised by (path, size, mtime) for big sources."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

_CHUNK = 16 * 1024 * 1024


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def json_sha256(obj: object) -> str:
    """Hash of a JSON-able object, key order independent: cache keys for build inputs."""
    return text_sha256(json.dumps(obj, sort_keys=True, default=str))


def dir_sha256(directory: Path, memo_file: Path | None = None) -> str:
    """One digest over every (relative path, file sha256) of a checkpoint directory."""
    memo: dict[str, str] = {}
    if memo_file and memo_file.is_file():
        try:
            memo = json.loads(memo_file.read_text())
        except (OSError, ValueError):
            memo = {}
    digest = hashlib.sha256()
    changed = False
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not _hidden(p, directory)):
        real = path.resolve()  # HF cache snapshots are symlinks into blobs/
        st = real.stat()
        key = f"{real}:{st.st_size}:{st.st_mtime_ns}"
        if key not in memo:
            memo[key] = file_sha256(real)
            changed = True
        digest.update(f"{path.relative_to(directory).as_posix()}\0{memo[key]}\n".encode())
    if memo_file and changed:
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_file)
    return digest.hexdigest()


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)
