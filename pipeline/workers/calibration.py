"""Calibration and evaluation text helpers shared by the quantizer workers (stdlib only)."""

from __future__ import annotations

import json
import random
from pathlib import Path

SELECTION_VERSION = 1  # part of cache keys: bump when the chunk selection below changes


def read_text(path: str | Path) -> str:
    """A .txt file as is; a .jsonl file's `text` fields joined by blank lines."""
    p = Path(path)
    if p.suffix == ".jsonl":
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        return "\n\n".join(row["text"] for row in rows)
    return p.read_text()


def calibration_chunks(ids: list[int], samples: int, seq_len: int, seed: int) -> list[list[int]]:
    """Non-overlapping windows of seq_len tokens; `samples` of them chosen with `seed` if more."""
    chunks = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if not chunks:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than seq_len {seq_len}")
    if len(chunks) > samples:
        keep = sorted(random.Random(seed).sample(range(len(chunks)), samples))
        chunks = [chunks[i] for i in keep]
    return chunks
