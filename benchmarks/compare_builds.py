"""Reproducibility: compare two builds of one recipe, target by target. Prints a markdown table,
asserts nothing.

For each target present in either build: whether the inputs hashes agree (same recipe, source,
toolchain and locks), how many of the artifact's files are byte-identical, and the largest
difference between the two builds' validation metrics (every engine's verdict; timings such as
tokens/s are left out: they measure the machine, not the artifact). Also the shared reference.

Usage: .venv/bin/python benchmarks/compare_builds.py ARTIFACTS_A ARTIFACTS_B [--recipe smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from pipeline.constants import STEP_KEY_FILE
from pipeline.hashing import file_sha256

TIMINGS = {"tokens_per_s", "prompt_tokens_per_s", "load_s", "seconds", "server_ready_s", "startup_s"}


def _manifest(root: Path, recipe: str, target: str) -> dict[str, Any] | None:
    path = root / recipe / target / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _numbers(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every numeric metric (nested dicts flattened), timings left out."""
    found: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        if key in TIMINGS:
            continue
        if isinstance(value, dict):
            found.update(_numbers(value, f"{prefix}{key}."))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            found[prefix + key] = float(value)
    return found


def _verdict_numbers(manifest: dict[str, Any]) -> dict[str, float]:
    validation = manifest.get("validation") or {}
    numbers = _numbers(validation.get("metrics") or {}, "")
    for engine, verdict in (validation.get("engines") or {}).items():
        numbers.update(_numbers(verdict.get("metrics") or {}, f"{engine}."))
    return numbers


def _largest_difference(a: dict[str, float], b: dict[str, float]) -> tuple[str, float]:
    """The metric whose two values differ most (relative), and by how much; ('', 0) if none."""
    worst, worst_key = 0.0, ""
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if math.isnan(x) and math.isnan(y):
            continue
        rel = abs(x - y) / max(abs(x), abs(y), 1e-12)
        if rel > worst:
            worst, worst_key = rel, key
    return worst_key, worst


def compare(root_a: Path, root_b: Path, recipe: str) -> list[dict[str, Any]]:
    targets = sorted(
        {p.parent.name for root in (root_a, root_b) for p in (root / recipe).glob("*/manifest.json")}
    )
    rows = []
    for target in targets:
        a, b = _manifest(root_a, recipe, target), _manifest(root_b, recipe, target)
        if a is None or b is None:
            rows.append({"target": target, "note": "built in one of the two only"})
            continue
        files_a = {f["path"]: f["sha256"] for f in a["files"]}
        files_b = {f["path"]: f["sha256"] for f in b["files"]}
        same = sorted(p for p in files_a if files_b.get(p) == files_a[p])
        differ = sorted(set(files_a) ^ set(files_b) | {p for p in files_a if p in files_b} - set(same))
        numbers_a, numbers_b = _verdict_numbers(a), _verdict_numbers(b)
        key, rel = _largest_difference(numbers_a, numbers_b)
        rows.append(
            {
                "target": target,
                "inputs_same": a["build"]["inputs_sha256"] == b["build"]["inputs_sha256"],
                "files_same": f"{len(same)}/{len(files_a)}",
                "files_differ": differ,
                "status": f"{a['validation']['status']} / {b['validation']['status']}",
                "metrics_same": numbers_a == numbers_b,
                "largest_metric_diff": f"{key} {rel:.2e}" if key else "none",
                "ppl_delta_pct": (
                    numbers_a.get("ppl_delta_pct"),
                    numbers_b.get("ppl_delta_pct"),
                ),
            }
        )
    return rows + _reference_row(root_a, root_b, recipe)


def _reference_row(root_a: Path, root_b: Path, recipe: str) -> list[dict[str, Any]]:
    """The shared reference directory (logits, PPL, generations), compared file by file."""
    dirs = [root / recipe / ".reference" for root in (root_a, root_b)]
    if not all(d.is_dir() for d in dirs):
        return [{"target": "(reference)", "note": "computed in one of the two only"}]
    a, b = ({p.name: file_sha256(p) for p in d.iterdir() if p.is_file()} for d in dirs)
    same = sorted(n for n in a if b.get(n) == a[n])
    return [
        {
            "target": "(reference)",
            "inputs_same": a.get(STEP_KEY_FILE) == b.get(STEP_KEY_FILE),
            "files_same": f"{len(same)}/{len(a)}",
            "files_differ": sorted(set(a) ^ set(b) | set(a) - set(same)),
            "status": "– / –",
            "metrics_same": a.get("reference.json") == b.get("reference.json"),
            "largest_metric_diff": "–",
            "ppl_delta_pct": (None, None),
        }
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts_a", type=Path)
    parser.add_argument("artifacts_b", type=Path)
    parser.add_argument("--recipe", default="smollm2-135m")
    args = parser.parse_args()
    rows = compare(args.artifacts_a, args.artifacts_b, args.recipe)
    print(
        "| target | inputs hash | files byte-identical | verdicts A / B | metrics | largest metric "
        "difference (relative) | ΔPPL % A / B | files that differ |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "note" in r:
            print(f"| {r['target']} | {r['note']} |||||||")
            continue
        ppl = " / ".join("–" if v is None else f"{v:+.4f}" for v in r["ppl_delta_pct"])
        print(
            f"| {r['target']} | {'same' if r['inputs_same'] else 'differs'} | {r['files_same']} | "
            f"{r['status']} | {'identical' if r['metrics_same'] else 'differ'} | "
            f"{r['largest_metric_diff']} | {ppl} | {', '.join(r['files_differ']) or '–'} |"
        )
    print(json.dumps(rows, default=str))


if __name__ == "__main__":
    main()
