"""Reading a recipe file: YAML, every section validated (pipeline.spec), every target by its kind's
class (pipeline.targets), and the files and shapes it names checked, before any build starts."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

import pipeline.targets  # noqa: F401  (registers every target kind in pipeline.spec.KINDS)
from pipeline.constants import KNOWN_HUB_CONFIGS, PACKAGED_SOURCES
from pipeline.errors import RecipeError
from pipeline.source import model_config
from pipeline.spec import (  # noqa: F401  (the recipe's models, importable from here too)
    CalibrationOverride,
    CalibrationSpec,
    EvaluationSpec,
    Gates,
    LlamaCppServe,
    LoadedRecipe,
    Recipe,
    ServeSpec,
    ServingBenchmarkSpec,
    SglangServe,
    SmokeSpec,
    SourceSpec,
    Strict,
    TargetSpec,
    TrtllmServe,
    VllmServe,
    describe_errors,
)


def load_recipe(path: str | Path, files: bool = True) -> LoadedRecipe:
    """Parse and validate a recipe file: every problem found, in one RecipeError naming the file,
    each key and why (`files` False: not whether the files it names exist on this host)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe file not found") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read recipe: {exc.strerror}") from None
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"{path}: {where}malformed YAML: {problem}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a YAML mapping, got {type(data).__name__}")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(f"{path}: {describe_errors(exc)}") from None
    loaded = LoadedRecipe(recipe=recipe, path=path.resolve(), sha256=hashlib.sha256(raw).hexdigest())
    problems = _file_problems(loaded) if files else []
    config = source_config(loaded)
    for name, spec in recipe.targets.items():
        problems += [f"targets.{name}.{p}" for p in spec.check(config)]
    if problems:
        raise RecipeError(f"{path}: {'; '.join(problems)}")
    return loaded


def source_config(loaded: LoadedRecipe) -> dict[str, Any] | None:
    """The source model's config.json if it can be read without building or downloading."""
    src = loaded.recipe.source
    path: Path | None = None
    if src.path:
        path = loaded.resolve_path(src.path) / "config.json"
    elif src.repo:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(src.repo, "config.json", revision=src.revision)
        path = Path(found) if isinstance(found, str) else None
        if path is None and src.repo in KNOWN_HUB_CONFIGS:
            return KNOWN_HUB_CONFIGS[src.repo]
    elif src.package:
        return PACKAGED_SOURCES[src.package].config
    return model_config(path) if path is not None else None


def _file_problems(loaded: LoadedRecipe) -> list[str]:
    """Local files the recipe names must exist now, not after an hour of building."""
    problems = []
    for used in loaded.local_inputs():  # a hub reference is fetched when the build first reads it
        if used.stage == "source":  # a checkpoint directory
            if not used.path.is_dir():
                problems.append(f"{used.key}: directory {used.ref!r} not found")
            elif not (used.path / "config.json").is_file():
                why = "has no config.json (not a Hugging Face checkpoint)"
                problems.append(f"{used.key}: {used.ref!r} {why}")
        elif not used.path.is_file():  # a text
            problems.append(f"{used.key}: file {used.ref!r} not found")
        elif used.path.stat().st_size == 0:
            problems.append(f"{used.key}: file {used.ref!r} is empty")
    return problems
