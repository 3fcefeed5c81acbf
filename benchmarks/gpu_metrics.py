"""The GPU host's metrics files (the report page's GPU rows) from the manifests its runs brought back.

    .venv/bin/python benchmarks/gpu_metrics.py benchmarks/results/h100-*-manifest.json --out gpu/artifacts

A device session often serves only some of a target's engines or workloads (`ENGINES`,
`ONLY_WORKLOAD`), so no one manifest holds all its numbers. For each recipe and target this writes
one metrics file (`pipeline.project.metrics_record`) from the latest manifest, each engine's
workloads taken from the latest manifest that served them: the same artifact bytes (its files'
digests) on the same GPU. A failed workload, or a later run of fewer levels (`CONCURRENCY`), leaves
the earlier one standing, as the serving table does. `serving_sources` names the manifest each
engine's workload came from; what was left out is printed."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from serving_table import fewer_levels, file_order

from pipeline.artifacts import write_json_atomic
from pipeline.constants import METRICS_DIRNAME
from pipeline.errors import PipelineError
from pipeline.hashing import json_sha256
from pipeline.manifest import Manifest, ServingResult, WorkloadRun, parse_manifest
from pipeline.project import metrics_record
from pipeline.spec import workload_shape


@dataclass(frozen=True)
class Measured:
    """One engine's numbers at one workload, and the manifest file they were recorded in."""

    run: WorkloadRun
    source: str


def files_digest(manifest: Manifest) -> str:
    """What identifies the artifact's bytes: every file's path, size and sha256."""
    return json_sha256([f.model_dump() for f in manifest.files])


def workloads(result: ServingResult) -> list[WorkloadRun]:
    """An engine's serving result as one run per workload, the first one included."""
    first = WorkloadRun(
        workload=result.workload,
        status=result.status,
        reason=result.reason,
        seconds=result.seconds,
        levels=result.levels,
        decode_bound=result.decode_bound,
    )
    return [first, *result.more_workloads] if result.workload else list(result.more_workloads)


def served(result: ServingResult) -> list[WorkloadRun]:
    """The workloads a result served whole (a failed or skipped one has no numbers to stand)."""
    return [run for run in workloads(result) if run.status == "passed" and run.levels]


def merged_serving(
    engine: str, found: list[tuple[str, ServingResult]]
) -> tuple[ServingResult, dict[str, str]]:
    """One engine's results (oldest first, each with its file) as one: the fields of the latest
    that served, each workload's numbers from the latest run that served it on that one's GPU."""
    serving = [(source, result, runs) for source, result in found if (runs := served(result))]
    if not serving:  # never served: the latest result as it was recorded (its reason)
        return found[-1][1], {}
    latest = serving[-1][1]
    best: dict[str, Measured] = {}
    for source, result, runs in serving:
        if result.device != latest.device:
            print(
                f"{source}: {engine} served on {result.device}, not {latest.device}: left out",
                file=sys.stderr,
            )
            continue
        for run in runs:  # a failed workload leaves the earlier numbers standing
            shape = workload_shape(run.workload)
            held = best.get(shape)
            if held and fewer_levels(run.levels, held.run.levels):
                print(f"{source}: {engine} {shape} ran levels {sorted(run.levels, key=int)} only: "
                      f"{held.source}'s stand", file=sys.stderr)  # fmt: skip
                continue
            best[shape] = Measured(run, source)
    ordered = sorted(
        best.values(), key=lambda m: (m.run.workload["prompt_tokens"], m.run.workload["output_tokens"])
    )
    first, *more = ordered
    merged = latest.model_copy(
        update={
            "status": "passed",
            "reason": None,
            "workload": first.run.workload,
            "seconds": first.run.seconds,
            "levels": first.run.levels,
            "decode_bound": first.run.decode_bound,
            "more_workloads": [m.run for m in more],
        }
    )
    return merged, {f"{engine} {workload_shape(m.run.workload)}": m.source for m in ordered}


def target_record(found: list[tuple[str, Manifest]]) -> dict[str, object]:
    """A target's metrics record from its manifests (oldest first): the latest's verdicts, every
    engine's workloads merged over the manifests of the same bytes."""
    source, latest = found[-1]
    digest = files_digest(latest)
    same = []
    for path, manifest in found:
        if files_digest(manifest) == digest:
            same.append((path, manifest))
        else:
            print(f"{path}: other bytes than {source}'s: left out", file=sys.stderr)
    serving, sources = {}, {}
    for engine in dict.fromkeys(e for _, m in same for e in m.serving):
        results = [(path, m.serving[engine]) for path, m in same if engine in m.serving]
        serving[engine], taken = merged_serving(engine, results)
        sources.update(taken)
    record = metrics_record(latest.model_copy(update={"serving": serving}))
    return {**record, "serving_sources": sources}


def write(manifests: list[Path], out: Path) -> list[Path]:
    """Every recipe's and target's metrics file under `out/<recipe>/.metrics/`."""
    groups: dict[tuple[str, str], list[tuple[str, Manifest]]] = {}
    for path in sorted(manifests, key=file_order):
        manifest = parse_manifest(path.read_text(), path)
        groups.setdefault((manifest.recipe, manifest.target), []).append((path.name, manifest))
    written = []
    for (recipe, target), found in groups.items():
        path = out / recipe / METRICS_DIRNAME / f"{target}.json"
        write_json_atomic(path, target_record(found))
        written.append(path)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "manifests", nargs="+", type=Path, help="collected manifests (<card>-DATE-...-manifest.json)"
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="the GPU host's artifacts root (gpu/artifacts)"
    )
    args = parser.parse_args()
    try:
        for path in write(args.manifests, args.out):
            print(path)
    except (OSError, PipelineError) as exc:  # an unreadable file, or one that is not a manifest
        print(f"gpu_metrics: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
