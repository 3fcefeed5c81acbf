"""One exclusive file lock that says who holds it (build locks, the GPU engine lock)."""

from __future__ import annotations

import fcntl
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def holding(path: Path, stamp: str, busy: Callable[[str], None]) -> Iterator[None]:
    """Hold an exclusive lock on `path`, whose text says who holds it (`stamp`) while held. If
    another process holds it, `busy(its stamp)` is called first: raise to give up, return to wait
    for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free = True
        except BlockingIOError:
            free = False
        if not free:  # outside the except: an error `busy` raises is its own, not a BlockingIOError's
            fh.seek(0)
            busy(fh.read().strip())
            fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        fh.truncate()
        fh.write(stamp)
        fh.flush()
        try:
            yield
        finally:
            fh.truncate(0)  # released: it names nobody
