"""The DVC pipelines agree with the recipes: every target has exactly one stage, CPU-host stages
never need a GPU engine, the GPU project (gpu/) is a subproject DVC leaves out of the CPU one, and
DVC itself parses both (the end-to-end `dvc repro` runs are in test_smollm2_e2e.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml
from dvc.repo import Repo

from pipeline.recipe import load_recipe
from pipeline.targets.trtllm import TrtllmTarget
from tests.conftest import REPO, empty_checkpoint, write_recipe

PIPELINES = {"cpu": REPO / "dvc.yaml", "gpu": REPO / "gpu" / "dvc.yaml"}


def _target_stages(path: Path, metrics_dir: str | None = None) -> dict[str, set[str]]:
    """recipe -> targets that the file's matrix stages build (those writing `metrics_dir` only)."""
    found: dict[str, set[str]] = {}
    for stage in yaml.safe_load(path.read_text())["stages"].values():
        matrix = stage.get("matrix")
        if matrix and metrics_dir and metrics_dir not in str(stage.get("metrics")):
            continue
        if matrix:
            for recipe in matrix["recipe"]:
                found.setdefault(recipe, set()).update(matrix["target"])
    return found


def test_every_recipe_target_has_exactly_one_stage() -> None:
    stages = {host: _target_stages(path) for host, path in PIPELINES.items()}
    stages["gpu-engines"] = _target_stages(PIPELINES["gpu"], metrics_dir=".metrics-gpu")
    recipes = set(stages["cpu"]) | set(stages["gpu"])
    assert recipes == {p.stem for p in (REPO / "recipes").glob("*.yaml")}
    for name in recipes:
        loaded = load_recipe(REPO / "recipes" / f"{name}.yaml")
        cpu, gpu = stages["cpu"].get(name, set()), stages["gpu"].get(name, set())
        assert not cpu & gpu, f"{name}: {cpu & gpu} in both pipelines"
        assert cpu | gpu == set(loaded.recipe.targets), f"{name}: stages differ from the recipe's targets"
        # A plain `dvc repro` on a CPU host must not reach a TensorRT-LLM engine.
        assert not {t for t in cpu if isinstance(loaded.recipe.targets[t], TrtllmTarget)}
        engines = stages["gpu-engines"].get(name, set())
        assert engines == {t for t, s in loaded.recipe.targets.items() if isinstance(s, TrtllmTarget)}
        # Recipes in the CPU pipeline have its source/reference stages; DVC tracks `serve`,
        # `serving_benchmark` and `calibration` as params of every target stage, so the recipe
        # must spell them out.
        data = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())
        assert {"serve", "serving_benchmark", "calibration", "evaluation", "smoke", "source"} <= set(data)


def test_declared_dvc_artifacts_are_cpu_pipeline_outputs() -> None:
    pipeline = yaml.safe_load(PIPELINES["cpu"].read_text())
    stages = _target_stages(PIPELINES["cpu"])
    for name, art in pipeline["artifacts"].items():
        recipe, target = art["path"].split("/")[1:3]
        assert name == f"{recipe}-{target}" and target in stages[recipe]


def test_dvc_parses_both_pipelines_and_the_cpu_project_never_sees_a_gpu_stage() -> None:
    """gpu/ is a DVC project of its own: a CPU host's plain `dvc status`/`pull`/`repro` (which
    collect the stages `dvc stage list --all` lists) never reach a GPU stage."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def stages(where: Path) -> set[str]:
        res = subprocess.run(
            ["dvc", "stage", "list", "--all", "--name-only"],
            cwd=where,
            capture_output=True,
            text=True,
            env=env,
        )
        assert res.returncode == 0, res.stderr
        return set(res.stdout.split())

    names, gpu_names = stages(REPO), stages(REPO / "gpu")
    assert "smollm2-135m@smollm2-135m-gguf-q4_0" in names
    assert not {n for n in names if "gpu/" in n or "trtllm" in n or "qwen2-7b" in n}, names
    assert (REPO / "gpu" / ".dvc" / "config").is_file()  # the subproject DVC leaves out of ./
    assert {
        "qwen2-7b-engines@qwen2-7b-trtllm-fp8",
        "smollm2-135m-engines@smollm2-135m-trtllm-int8",
    } <= gpu_names
    assert {"source@smollm2-135m", "reference@smollm2-135m", "report@qwen2-7b"} <= gpu_names
    for where, stage in ((REPO, "reference@smollm2-135m"), (REPO / "gpu", "reference@qwen2-7b")):
        dag = subprocess.run(["dvc", "dag", "--md"], cwd=where, capture_output=True, text=True, env=env)
        assert dag.returncode == 0 and stage in dag.stdout, dag.stderr
    # The default recipe's lock file is committed: a newcomer's repro starts from it.
    lock = yaml.safe_load((REPO / "dvc.lock").read_text())
    assert set(lock["stages"]) == names


def _lookup(data: dict, dotted: str) -> object:
    """`targets.gguf-q8_0` -> data["targets"]["gguf-q8_0"] (DVC's params keys)."""
    for key in dotted.split("."):
        data = data[key]
    return data


def test_the_committed_lock_is_current_with_the_recipes() -> None:
    """Every param that the committed dvc.lock recorded is the recipe's value today, so a fresh
    clone's `dvc status` reports no changed params, and a changed recipe shows up here, not as a
    surprise rebuild on a newcomer's machine (regenerate with `dvc repro`, then commit dvc.lock)."""
    lock = yaml.safe_load((REPO / "dvc.lock").read_text())
    checked = 0
    for stage, entry in lock["stages"].items():
        for path, params in entry.get("params", {}).items():
            recipe = yaml.safe_load((REPO / path).read_text())
            for key, recorded in params.items():
                stale = f"dvc.lock {stage}: {path}:{key} is stale (run dvc repro)"
                assert _lookup(recipe, key) == recorded, stale
                checked += 1
    assert checked >= len(lock["stages"])


def _unlisted_local_inputs(project: Path) -> list[str]:
    """One line per local file or directory a stage's recipe makes it read (source.path for
    `source`, evaluation.text for `reference`, calibration.dataset for `build`) that is not among
    the stage's deps: edited in place, DVC would call the stage up to date (`pipeline build` itself
    would not: the text's bytes are in its inputs hash)."""
    problems = []
    with Repo(str(project)) as repo:
        for stage in repo.index.stages:
            m = re.search(r"pipeline (source|reference|build) (\S+\.yaml)", stage.cmd or "")
            if not m:
                continue
            deps = [Path(d.fs_path).resolve() for d in stage.deps]
            for used in load_recipe(Path(stage.wdir) / m[2]).local_inputs():
                if used.stage != m[1]:  # a built-in text too: its file under pipeline/data
                    continue
                if not any(used.path.resolve().is_relative_to(d) for d in deps):  # itself or a dir above
                    problems.append(f"{stage.name}: {used.key} {used.ref!r} is not among its deps")
    return problems


def test_every_local_file_a_recipe_reads_is_a_dep_of_the_stage_that_reads_it() -> None:
    for project in (REPO, REPO / "gpu"):
        assert _unlisted_local_inputs(project) == [], project


def test_a_local_calibration_text_missing_from_the_deps_is_named(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    empty_checkpoint(recipes / "model")
    (recipes / "calib.txt").write_text("Some calibration text.\n" * 50)
    write_recipe(recipes / "tiny.yaml", calibration={"dataset": "calib.txt", "samples": 4, "seq_len": 64})
    stage = {
        "cmd": "pipeline build recipes/tiny.yaml --targets gguf-f16",
        "deps": ["recipes/model"],
        "outs": ["artifacts/tiny/gguf-f16"],
    }
    pipeline = tmp_path / "dvc.yaml"
    pipeline.write_text(yaml.safe_dump({"stages": {"tiny-gguf-f16": stage}}))
    assert _unlisted_local_inputs(tmp_path) == [
        "tiny-gguf-f16: calibration.dataset 'calib.txt' is not among its deps"
    ]
    stage["deps"].append("recipes/calib.txt")
    pipeline.write_text(yaml.safe_dump({"stages": {"tiny-gguf-f16": stage}}))
    assert _unlisted_local_inputs(tmp_path) == []
