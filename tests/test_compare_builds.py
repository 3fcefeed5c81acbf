"""benchmarks/compare_builds.py: the reproducibility table's shared-reference row."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from compare_builds import compare


def _reference(root: Path, files: dict[str, str]) -> None:
    ref = root / "r" / ".reference"
    ref.mkdir(parents=True)
    for name, text in files.items():
        (ref / name).write_text(text)


def test_the_reference_row_names_the_files_that_differ(tmp_path: Path) -> None:
    same = {".inputs.sha256": "k", "logits.npy": "L"}
    _reference(tmp_path / "a", {**same, "reference.json": '{"ppl": 1}'})
    _reference(tmp_path / "b", {**same, "reference.json": '{"ppl": 2}'})
    (row,) = compare(tmp_path / "a", tmp_path / "b", "r")
    assert row["target"] == "(reference)" and row["inputs_same"]
    assert row["files_same"] == "2/3" and row["files_differ"] == ["reference.json"]
    assert not row["metrics_same"]


def test_a_reference_in_one_build_only_is_said(tmp_path: Path) -> None:
    _reference(tmp_path / "a", {"logits.npy": "L"})
    (tmp_path / "b" / "r").mkdir(parents=True)
    assert compare(tmp_path / "a", tmp_path / "b", "r") == [
        {"target": "(reference)", "note": "computed in one of the two only"}
    ]
