"""Cluster-path benchmark: prints numbers, asserts nothing.

In one run, on this host: (a) a plain `pipeline build RECIPE` and (b) `pipeline build RECIPE
--cluster local` (Ray started in-process, one node advertising this host's environments), each
into a fresh artifacts root with a cold reference; wall times and their ratio, then each target's
manifests compared (file hashes, inputs hash, verdicts, validation numbers). Then what the cluster
path adds per task: starting a Ray node, one task's round trip with a build's resources, and the
publish step (copy into `.incoming/`, the driver's re-hash) measured on the largest artifact.

Usage: .venv/bin/python benchmarks/bench_cluster.py [RECIPE] [--targets a,b] [--workdir bench-cluster]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PIPELINE = [sys.executable, "-m", "pipeline"]


def timed_build(recipe: Path, root: Path, extra: list[str], env: dict[str, str]) -> float:
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    run_env = {**env, "PIPELINE_ARTIFACTS": str(root)}
    argv = [*PIPELINE, "build", str(recipe), *extra]
    done = subprocess.run(argv, cwd=REPO, env=run_env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    print(done.stdout[-3000:])
    if done.returncode not in (0, 7):  # 7: a target failed its gates, still a comparable build
        sys.exit(f"build {' '.join(extra) or '(plain)'} exited {done.returncode}: {done.stderr[-2000:]}")
    return seconds


def manifests(recipe_dir: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(recipe_dir.glob("*/manifest.json"))}


def compare(plain: dict[str, dict], cluster: dict[str, dict]) -> None:
    print("| target | files identical | inputs identical | verdicts (plain / cluster) "
          "| ΔPPL % (plain / cluster) | built on |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for target in sorted(plain.keys() | cluster.keys()):
        a, b = plain.get(target), cluster.get(target)
        if a is None or b is None:
            print(f"| {target} | only in {'plain' if b is None else 'cluster'} build | | | | |")
            continue
        files = [(f["path"], f["sha256"]) for f in a["files"]] == [
            (f["path"], f["sha256"]) for f in b["files"]
        ]
        inputs = a["build"]["inputs_sha256"] == b["build"]["inputs_sha256"]
        verdicts = [{e: v["status"] for e, v in m["validation"]["engines"].items()} for m in (a, b)]
        deltas = [(m["validation"].get("metrics") or {}).get("ppl_delta_pct") for m in (a, b)]
        print(f"| {target} | {files} | {inputs} | {verdicts[0]} / {verdicts[1]} | {deltas[0]} / {deltas[1]} "
              f"| {b['build'].get('host')} node {str(b['build'].get('node'))[:12]} |")  # fmt: skip


def task_overheads(largest: Path, work: Path) -> None:
    """Ray node start, a no-op task's round trip with a build's resources, publish of `largest`."""
    import ray

    from pipeline.artifacts import verify_files
    from pipeline.cluster import RESOURCE_SLOT, _copy_complete, node_resources
    from pipeline.manifest import read_manifest

    t0 = time.perf_counter()
    ray.init(address="local", resources=node_resources(), include_dashboard=False, log_to_driver=False)
    print(f"Ray local node start: {time.perf_counter() - t0:.1f} s")
    noop = ray.remote(lambda: os.getpid()).options(resources={RESOURCE_SLOT: 1.0}, num_cpus=0)
    rounds = []
    for _ in range(20):
        t = time.perf_counter()
        ray.get(noop.remote())
        rounds.append((time.perf_counter() - t) * 1000)
    print(f"task round trip (20 tasks): first {rounds[0]:.0f} ms, median of the rest "
          f"{statistics.median(rounds[1:]):.1f} ms")  # fmt: skip
    ray.shutdown()

    manifest = read_manifest(largest)
    size_mib = sum(f.bytes for f in manifest.files) / 2**20
    dst = work / "incoming-copy"
    shutil.rmtree(dst, ignore_errors=True)
    t = time.perf_counter()
    _copy_complete(largest, dst)
    copy_s = time.perf_counter() - t
    t = time.perf_counter()
    problems = verify_files(dst, manifest.files)
    verify_s = time.perf_counter() - t
    print(f"publish of {largest.name} ({size_mib:.0f} MiB, local disk): copy into .incoming {copy_s:.2f} s, "
          f"driver re-hash {verify_s:.2f} s, problems {problems}")  # fmt: skip
    shutil.rmtree(dst, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=str(REPO / "recipes" / "smollm2-135m.yaml"))
    parser.add_argument("--workdir", default="bench-cluster")
    parser.add_argument("--targets", default="", help="comma-separated subset (default: all)")
    args = parser.parse_args()
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    recipe = Path(args.recipe).resolve()
    from pipeline.recipe import load_recipe

    name = load_recipe(recipe).recipe.name
    env = {**os.environ, "PIPELINE_NODE_WORKSPACE": str(work / "nodes")}
    env.pop("PIPELINE_CLUSTER", None)
    shutil.rmtree(work / "nodes", ignore_errors=True)

    subset = ["--targets", args.targets] if args.targets else []
    plain_s = timed_build(recipe, work / "plain", subset, env)
    cluster_s = timed_build(recipe, work / "cluster", [*subset, "--cluster", "local"], env)
    print(f"plain build: {plain_s:.1f} s; --cluster local: {cluster_s:.1f} s; "
          f"ratio cluster/plain {cluster_s / plain_s:.3f}")  # fmt: skip
    plain, cluster = manifests(work / "plain" / name), manifests(work / "cluster" / name)
    compare(plain, cluster)
    largest = max(cluster, key=lambda t: sum(f["bytes"] for f in cluster[t]["files"]))
    task_overheads(work / "cluster" / name / largest, work)


if __name__ == "__main__":
    main()
