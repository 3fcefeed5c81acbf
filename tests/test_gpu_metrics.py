"""The GPU host's metrics files (benchmarks/gpu_metrics.py): each target's engines and workloads from
the latest manifest that served them, over manifests of the same bytes on the same GPU; the
committed files are the ones the committed manifests give."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_metrics

RESULTS = REPO / "benchmarks" / "results"
Q8_512 = RESULTS / "h100-2026-12-06-serving-run2-gguf-q8_0-manifest.json"  # 512/128, 4 levels
Q8_2048 = RESULTS / "h100-2026-12-07-serving-gguf-q8_0-manifest.json"  # 2048/256, 4 levels


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _write(directory: Path, name: str, manifest: dict[str, Any]) -> Path:
    path = directory / name
    path.write_text(json.dumps(manifest))
    return path


def _record(directory: Path, *paths: Path) -> dict[str, Any]:
    (written,) = gpu_metrics.write(list(paths), directory / "out")
    return json.loads(written.read_text())


def _tps(record: dict[str, Any], key: str) -> float:
    return record[f"serving_{key}_output_tokens_per_s"]


def test_each_workload_comes_from_the_run_that_served_it(tmp_path: Path) -> None:
    record = _record(tmp_path, Q8_2048, Q8_512)  # (given newest first: ordered by their names)
    first = _manifest(Q8_512)["serving"]["llama.cpp"]["levels"]["1"]["output_tokens_per_s"]
    later = _manifest(Q8_2048)["serving"]["llama.cpp"]["levels"]["1"]["output_tokens_per_s"]
    assert record["serving_workload"] == "512/128" and record["serving_c1_output_tokens_per_s"] == first
    assert _tps(record, "2048x256_c1") == later and _tps(record, "2048x256_c128") is not None
    assert record["serving_sources"] == {"llama.cpp 512/128": Q8_512.name, "llama.cpp 2048/256": Q8_2048.name}
    assert record["ppl_delta_pct"] == _manifest(Q8_2048)["validation"]["metrics"]["ppl_delta_pct"]


def test_a_later_run_of_fewer_levels_leaves_the_fuller_one_standing(tmp_path: Path) -> None:
    fewer = _manifest(Q8_2048)
    levels = fewer["serving"]["llama.cpp"]["levels"]
    fewer["serving"]["llama.cpp"]["levels"] = {"1": {**levels["1"], "output_tokens_per_s": 1.0}}
    later = _write(tmp_path, "h100-2026-12-09-serving-gguf-q8_0-manifest.json", fewer)
    record = _record(tmp_path, Q8_2048, later)
    assert _tps(record, "c1") == levels["1"]["output_tokens_per_s"]
    assert record["serving_sources"] == {"llama.cpp 2048/256": Q8_2048.name}


@pytest.mark.parametrize(
    "change",
    ["failed", "skipped", "other bytes", "other gpu"],
)
def test_a_later_run_that_did_not_serve_these_bytes_here_leaves_the_numbers_standing(
    tmp_path: Path, change: str
) -> None:
    later = _manifest(Q8_2048)
    result = later["serving"]["llama.cpp"]
    if change in ("failed", "skipped"):
        result.update(
            status=change, reason="the server died", levels={} if change == "skipped" else result["levels"]
        )
    elif change == "other bytes":
        later["files"][0]["sha256"] = "0" * 64
    else:
        result["device"] = "NVIDIA H200"
    result["levels"] = copy.deepcopy(result["levels"])
    for level in result["levels"].values():
        level["output_tokens_per_s"] = 1.0
    path = _write(tmp_path, "h100-2026-12-09-serving-gguf-q8_0-manifest.json", later)
    record = _record(tmp_path, Q8_512, Q8_2048, path)
    if change in ("failed", "skipped"):  # the earlier numbers stand, and say where they are from
        assert _tps(record, "2048x256_c1") > 1.0 and record["serving_llama.cpp"] == "passed"
        assert record["serving_sources"] == {
            "llama.cpp 512/128": Q8_512.name,
            "llama.cpp 2048/256": Q8_2048.name,
        }
    else:  # the latest bytes on the latest GPU, alone: no earlier number is taken for them
        assert record["serving_sources"] == {"llama.cpp 2048/256": path.name}
        assert record["serving_workload"] == "2048/256" and _tps(record, "c1") == 1.0
        assert not any(key.startswith("serving_2048x256") for key in record)


def test_the_committed_metrics_are_what_the_committed_manifests_give(tmp_path: Path) -> None:
    manifests = sorted(RESULTS.glob("h100-*-manifest.json"))
    written = gpu_metrics.write(manifests, tmp_path)
    committed = sorted((REPO / "gpu" / "artifacts").glob("*/.metrics/*.json"))
    assert sorted(p.relative_to(tmp_path) for p in written) == [
        p.relative_to(REPO / "gpu" / "artifacts") for p in committed
    ]
    for path in committed:
        got = json.loads((tmp_path / path.relative_to(REPO / "gpu" / "artifacts")).read_text())
        assert got == json.loads(path.read_text()), f"{path}: run benchmarks/gpu_metrics.py (README)"


def test_a_corrupted_manifest_is_a_one_line_error_and_nothing_is_written(tmp_path: Path) -> None:
    bad = tmp_path / "h100-2026-12-09-serving-gguf-q8_0-manifest.json"
    bad.write_text(Q8_2048.read_text()[:500])
    script = REPO / "benchmarks" / "gpu_metrics.py"
    argv = [sys.executable, str(script), str(Q8_512), str(bad), "--out", str(tmp_path / "out")]
    got = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    assert got.returncode == 1 and not (tmp_path / "out").exists()
    assert got.stderr.count("\n") == 1 and f"{bad} is corrupted" in got.stderr
