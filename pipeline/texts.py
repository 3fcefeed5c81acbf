"""Calibration and evaluation texts: `builtin:<name>`, a local .txt/.jsonl, or a Hugging Face dataset
at a pinned revision, `hf:<repo>@<40-hex>:<config>/<split>[:<column>]`.

A dataset reference is fetched with huggingface_hub (so it honours HF_HOME / HF_HUB_CACHE and
HF_HUB_OFFLINE like a hub source), only the files of that config and split, read with `datasets`,
and written once as a plain text file under the pipeline cache; every worker and llama.cpp tool then
reads that file. Rows that end in a newline (wikitext's lines) are kept as they are, an empty row
is a newline, other rows (documents) end in a blank line.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline.artifacts import cached_step
from pipeline.errors import SourceError
from pipeline.hashing import json_sha256

HF_PREFIX = "hf:"
TEXTS_VERSION = 1  # part of the cache key: bump when the rows-to-text rule below changes
_HF_REF = re.compile(
    r"^hf:(?P<repo>[\w.-]+(?:/[\w.-]+)?)@(?P<revision>[0-9a-f]{40})"
    r":(?P<config>[\w.-]+)/(?P<split>[\w.-]+)(?::(?P<column>[\w.-]+))?$"
)
# Where the Hub's dataset repos keep a config's split when their README names no data files
# (the layouts the Hub's parquet conversion and `push_to_hub` write).
_CONVENTIONAL = ("{config}/{split}-*", "{config}/{split}/*", "{config}/{split}.*")
_CONVENTIONAL_DEFAULT = ("data/{split}-*", "data/{split}/*", "data/{split}.*", "{split}-*", "{split}.*")
_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".txt": "text"}


@dataclass(frozen=True)
class HfTextRef:
    """One column of one split of a Hub dataset at a pinned commit."""

    repo: str
    revision: str
    config: str
    split: str
    column: str = "text"

    def __str__(self) -> str:
        return f"hf:{self.repo}@{self.revision}:{self.config}/{self.split}:{self.column}"


def parse_hf_ref(value: str) -> HfTextRef:
    """`hf:<repo>@<40-hex>:<config>/<split>[:<column>]`; ValueError naming the expected form."""
    m = _HF_REF.match(value)
    if not m:
        raise ValueError(
            f"{value!r} is not a dataset reference of the form "
            "hf:<repo>@<40-hex commit>:<config>/<split>[:<column>]"
        )
    return HfTextRef(**{k: v for k, v in m.groupdict().items() if v is not None})


def dataset_text(ref: HfTextRef, cache: Path) -> Path:
    """The text file of `ref` under `cache`, fetched and written on first use (SourceError when the
    dataset cannot be had: offline and not cached, no such config/split/column, no rows)."""
    out = cache / "texts" / f"{ref.repo.replace('/', '--')}@{ref.revision[:12]}" / ref.config
    out = out / f"{ref.split}.{ref.column}"
    key = json_sha256({"ref": str(ref), "version": TEXTS_VERSION})
    cached_step(out, key, lambda tmp: _write_text(ref, tmp), out.with_name(f".{out.name}.lock"))
    return out / "text.txt"


def _write_text(ref: HfTextRef, tmp: Path) -> None:
    snapshot, files = _fetch(ref)
    rows = _rows(ref, files)
    text = "".join(row if row.endswith("\n") else f"{row}\n\n" if row else "\n" for row in rows)
    if not text.strip():
        raise SourceError(f"{ref}: the column holds no text")
    (tmp / "text.txt").write_text(text)
    record = {
        "ref": str(ref),
        "files": [str(f.relative_to(snapshot)) for f in files],
        "rows": len(rows),
        "chars": len(text),
    }
    (tmp / "text.json").write_text(json.dumps(record, indent=2))


def _fetch(ref: HfTextRef) -> tuple[Path, list[Path]]:
    """The snapshot directory and the data files of ref's config and split, downloading only those."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    where = f"dataset {ref.repo}@{ref.revision[:12]}"
    try:
        readme = snapshot_download(
            ref.repo, repo_type="dataset", revision=ref.revision, allow_patterns=["README.md"]
        )
        patterns = data_file_patterns(Path(readme) / "README.md", ref.config, ref.split)
        snapshot = Path(
            snapshot_download(ref.repo, repo_type="dataset", revision=ref.revision, allow_patterns=patterns)
        )
    except LocalEntryNotFoundError:
        raise SourceError(
            f"{where} is not in the local HF cache and the hub cannot be reached (offline?). To "
            "resolve, download it on a connected machine or use a local text file"
        ) from None
    except HfHubHTTPError as exc:
        raise SourceError(f"hub download of {where} failed: {exc}") from None
    files = sorted(
        p
        for p in snapshot.rglob("*")
        if p.is_file() and any(fnmatch.fnmatch(str(p.relative_to(snapshot)), pat) for pat in patterns)
    )
    if not files:
        raise SourceError(
            f"{where} has no data files for config {ref.config!r} split {ref.split!r} "
            f"(looked for {', '.join(patterns)})"
        )
    return snapshot, files


def data_file_patterns(readme: Path, config: str, split: str) -> list[str]:
    """The split's data files as the dataset card's `configs:` section names them, else the Hub's
    conventional layouts."""
    card = _card_configs(readme)
    if card is not None:
        if config not in card:
            raise SourceError(f"dataset has no config {config!r} (configs: {', '.join(card)})")
        files = card[config]
        if isinstance(files, str) or (isinstance(files, list) and all(isinstance(f, str) for f in files)):
            found = {"train": files}  # one unnamed split is `train` on the Hub
        elif isinstance(files, dict):
            found = files
        else:
            found = {e["split"]: e["path"] for e in files or [] if isinstance(e, dict) and "split" in e}
        if split not in found:
            raise SourceError(f"config {config!r} has no split {split!r} (splits: {', '.join(found)})")
        paths = found[split]
        return [paths] if isinstance(paths, str) else list(paths)
    layouts = _CONVENTIONAL_DEFAULT if config == "default" else _CONVENTIONAL
    return [p.format(config=config, split=split) for p in layouts]


def _card_configs(readme: Path) -> dict[str, Any] | None:
    """config_name -> data_files from a dataset card's YAML header; None without one."""
    if not readme.is_file():
        return None
    text = readme.read_text(errors="replace")
    if not text.startswith("---"):
        return None
    header = text.split("---", 2)[1]
    try:
        meta = yaml.safe_load(header) or {}
    except yaml.YAMLError:
        return None
    configs = meta.get("configs") if isinstance(meta, dict) else None
    if not isinstance(configs, list):
        return None
    return {str(c.get("config_name", "default")): c.get("data_files") for c in configs if isinstance(c, dict)}


def _rows(ref: HfTextRef, files: list[Path]) -> list[str]:
    """The column's values, read by `datasets` with the builder the files' format needs."""
    import datasets

    suffixes = {"".join(s for s in f.suffixes if s not in (".gz", ".zst", ".bz2", ".xz")) for f in files}
    builder = _BUILDERS.get(suffixes.pop(), "json") if len(suffixes) == 1 else None
    if builder is None:
        raise SourceError(f"{ref}: mixed data file formats {sorted(suffixes)}")
    data = datasets.load_dataset(builder, data_files={ref.split: [str(f) for f in files]}, split=ref.split)
    if ref.column not in data.column_names:
        raise SourceError(f"{ref}: no column {ref.column!r} (columns: {', '.join(data.column_names)})")
    return [str(v) for v in data[ref.column] if v is not None]
