"""Calibration and evaluation text helpers shared by the quantizer workers (stdlib only)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SELECTION_VERSION = 2  # part of cache keys: bump when the chunk selection below changes
# 2: chunks start with BOS when the model's tokenizer adds one (as llama-imatrix's do)


def read_text(path: str | Path) -> str:
    """A .txt file as is; a .jsonl file's `text` fields joined by blank lines."""
    p = Path(path)
    if p.suffix == ".jsonl":
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        return "\n\n".join(row["text"] for row in rows)
    return p.read_text()


def bos_id(tok: Any) -> int | None:
    """The BOS token id when the model's tokenizer puts one before a text, else None: the rule
    llama.cpp's tools read from the GGUF's `tokenizer.ggml.add_bos_token`, which its converter
    takes from the same tokenizer."""
    bos = getattr(tok, "bos_token_id", None)
    if bos is None:
        return None
    framed = tok("a")["input_ids"]
    return int(bos) if framed and framed[0] == bos else None


def document_ids(tok: Any, text: str) -> tuple[list[int], int | None]:
    """A text's token ids framed as the model's tokenizer frames a document (BOS first when it adds
    one; no EOS), and that BOS id. Special-token text inside the document stays text."""
    ids = [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]
    bos = bos_id(tok)
    return ([bos, *ids] if bos is not None else ids), bos


def bos_windows(ids: list[int], size: int, bos: int | None) -> list[list[int]]:
    """Non-overlapping windows of `size` tokens, each starting with BOS when there is one (its first
    token replaced, as llama-perplexity and llama-imatrix do with every chunk)."""
    out = [list(ids[i : i + size]) for i in range(0, len(ids) - size + 1, size)]
    if bos is not None:
        for w in out:
            w[0] = bos
    return out


def calibration_chunks(
    ids: list[int], samples: int, seq_len: int, seed: int, bos: int | None = None
) -> list[list[int]]:
    """Non-overlapping windows of seq_len tokens (each starting with `bos` if given); `samples` of
    them chosen with `seed` if more."""
    chunks = bos_windows(ids, seq_len, bos)
    if not chunks:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than seq_len {seq_len}")
    if len(chunks) > samples:
        keep = sorted(random.Random(seed).sample(range(len(chunks)), samples))
        chunks = [chunks[i] for i in keep]
    return chunks
