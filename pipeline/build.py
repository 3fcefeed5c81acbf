"""Build a recipe: resolve the source, build each target in staging, validate, publish."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline.artifacts import (
    Layout,
    artifacts_root,
    build_lock,
    file_entries,
    publish,
    read_manifest,
    write_json_atomic,
    write_manifest,
)
from pipeline.constants import MANIFEST_NAME, MANIFEST_SCHEMA, STATUS_UNAVAILABLE
from pipeline.errors import DiskFullError, PipelineError
from pipeline.hashing import json_sha256
from pipeline.recipe import TargetSpec, load_recipe, select_targets
from pipeline.registry import Registry
from pipeline.source import resolve_source
from pipeline.targets import BUILDERS, BuildContext
from pipeline.targets.base import NullReporter, Reporter
from pipeline.workers import is_disk_full


@dataclass
class TargetResult:
    """What happened to one target: built, up-to-date, planned or error."""

    target: str
    outcome: str
    path: Path
    validation: str | None = None
    message: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    exit_code: int = 0
    plan: dict[str, Any] | None = None  # dry runs: commands and configs the build would use


def build_recipe(
    recipe_path: str | Path,
    targets: list[str] | None = None,
    *,
    dry_run: bool = False,
    force: bool = False,
    root: Path | None = None,
    reporter: Reporter | None = None,
    threads: int = 0,
) -> list[TargetResult]:
    """Build the selected targets of a recipe; one target's failure does not stop the others.

    A target whose engine this host lacks is `unavailable` (nothing built, nothing recorded). A
    full disk stops the build (every later target would fail the same way). The source is
    resolved when the first target needs it.
    """
    loaded = load_recipe(recipe_path)
    selected = select_targets(loaded.recipe, targets)
    layout = Layout(root or artifacts_root(), loaded.recipe.name)
    if dry_run:
        return [
            TargetResult(
                name,
                "planned",
                layout.target_dir(name),
                message=_describe(spec),
                plan=BUILDERS[spec.kind].plan(layout, name, spec),
            )
            for name, spec in selected.items()
        ]
    reporter = reporter or NullReporter()
    ctx = BuildContext(
        loaded=loaded,
        source_resolver=lambda: resolve_source(loaded, layout.logs_dir / "source.log"),
        layout=layout,
        reporter=reporter,
        threads=threads,
    )
    results = []
    for name, spec in selected.items():
        t0 = time.perf_counter()
        try:
            result = _build_target(ctx, name, spec, force)
        except DiskFullError:
            raise
        except PipelineError as exc:
            result = TargetResult(
                name, "error", layout.target_dir(name), message=str(exc), exit_code=exc.exit_code
            )
        result.seconds = time.perf_counter() - t0
        results.append(result)
    return results


def prepare_source(recipe_path: str | Path, root: Path | None = None) -> Path:
    """Resolve the source and write its record (the DVC `source` stage's output)."""
    loaded = load_recipe(recipe_path)
    layout = Layout(root or artifacts_root(), loaded.recipe.name)
    source = resolve_source(loaded, layout.logs_dir / "source.log")
    write_json_atomic(layout.source_record, {"recipe": loaded.recipe.name, "source": source.info})
    return layout.source_record


def prepare_reference(
    recipe_path: str | Path, root: Path | None = None, reporter: Reporter | None = None
) -> Path:
    """Compute (or reuse) the transformers reference (the DVC `reference` stage's output)."""
    loaded = load_recipe(recipe_path)
    layout = Layout(root or artifacts_root(), loaded.recipe.name)
    source = resolve_source(loaded, layout.logs_dir / "source.log")
    ctx = BuildContext(
        loaded=loaded, source_resolver=lambda: source, layout=layout, reporter=reporter or NullReporter()
    )
    return ctx.reference()[1]


def write_metrics(layout: Layout, target: str, manifest: dict[str, Any], gpu_host: bool = False) -> None:
    """One target's validation numbers, for `dvc metrics show` and the recipe's report."""
    validation = manifest.get("validation", {})
    m = validation.get("metrics", {})
    record = {
        "status": validation.get("status"),
        "engine": manifest["engine"],
        "quant": manifest["quant"],
        "size_mib": round(sum(f["bytes"] for f in manifest.get("files", [])) / 2**20, 2),
        **{k: m.get(k) for k in ("ppl", "ppl_ref", "ppl_delta_pct", "kld_mean", "token_agreement")},
        **{k: m.get(k) for k in ("top1_agreement", "tokens_per_s")},
    }
    write_json_atomic(layout.metrics_path(target, gpu_host), record)


def write_report(recipe_path: str | Path, root: Path | None = None) -> list[dict[str, Any]]:
    """Every target's metrics of a recipe as one list (the DVC size-vs-ΔPPL scatter's data)."""
    loaded = load_recipe(recipe_path)
    layout = Layout(root or artifacts_root(), loaded.recipe.name)
    rows = []
    for target in loaded.recipe.targets:
        for path in (layout.metrics_path(target), layout.metrics_path(target, gpu_host=True)):
            if path.is_file():
                rows.append({"target": target, **json.loads(path.read_text())})
    write_json_atomic(layout.report_path, rows)
    return rows


def _describe(spec: TargetSpec) -> str:
    fields = spec.model_dump(exclude={"kind", "gates"})
    return f"{spec.kind} " + " ".join(f"{k}={v}" for k, v in fields.items())


def _inputs_sha256(
    ctx: BuildContext, name: str, spec: TargetSpec, toolchain: dict[str, Any], serve_command: str
) -> str:
    """Everything that decides an artifact's bytes and its validation numbers."""
    r = ctx.loaded.recipe
    return json_sha256(
        {
            "target": name,
            "spec": spec.model_dump(),
            "source": ctx.source.sha256,
            "calibration": r.calibration.model_dump() if r.calibration else None,
            "evaluation": r.evaluation.model_dump(),
            "smoke": r.smoke.model_dump(),
            "serve": serve_command,  # carries the recipe's serving knobs this target uses
            "toolchain": toolchain,
        }
    )


def _build_target(ctx: BuildContext, name: str, spec: TargetSpec, force: bool) -> TargetResult:
    reason = BUILDERS[spec.kind].unavailable(ctx, name, spec)
    if reason is not None:
        final = ctx.layout.target_dir(name)
        return TargetResult(name, STATUS_UNAVAILABLE, final, validation=STATUS_UNAVAILABLE, message=reason)
    with build_lock(ctx.layout, name):
        return _build_target_locked(ctx, name, spec, force)


def _build_target_locked(ctx: BuildContext, name: str, spec: TargetSpec, force: bool) -> TargetResult:
    builder = BUILDERS[spec.kind]
    final = ctx.layout.target_dir(name)
    toolchain: dict[str, Any] = {}
    for env in builder.environments:
        toolchain.update(ctx.toolchain(env)["toolchain"])
    serve_command = builder.serve_command(spec, ctx.loaded.recipe.serve)
    inputs = _inputs_sha256(ctx, name, spec, toolchain, serve_command)
    if not force and (final / MANIFEST_NAME).is_file():
        old = read_manifest(final)
        if old.get("build", {}).get("inputs_sha256") == inputs:
            Registry(ctx.layout.root).register(final)
            write_metrics(ctx.layout, name, old, builder.gpu_host)
            return _result(name, "up-to-date", final, old)

    t0 = time.perf_counter()
    staging = ctx.layout.new_staging(name)
    try:
        ctx.reporter.step(name, "building")
        built = builder.build(ctx, name, spec, staging)
        build_s = time.perf_counter() - t0
        files = file_entries(staging)
        validation = builder.validate(ctx, name, spec, staging)
        manifest = {
            "schema": MANIFEST_SCHEMA,
            "recipe": ctx.loaded.recipe.name,
            "recipe_sha256": ctx.loaded.sha256,
            "recipe_path": str(ctx.loaded.path),
            "target": name,
            "kind": spec.kind,
            "engine": built.pop("engine", builder.engine),
            "format": builder.format,
            "quant": built.pop("quant"),
            "source": ctx.source.info,
            "files": files,
            "toolchain": toolchain,
            "build": {
                "seconds": round(build_s, 2),
                "gpu_arch": built.pop("gpu_arch", None),
                "profile": built.pop("profile", None),
                "inputs_sha256": inputs,
                "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "spec": spec.model_dump(exclude={"gates"}),
            },
            "validation": validation,
            "serve": {"command": serve_command},
            **built,
        }
        write_manifest(staging, manifest)
        publish(staging, final)
        Registry(ctx.layout.root).register(final)
        write_metrics(ctx.layout, name, manifest, builder.gpu_host)
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFullError(f"{name}: no space left on device in {ctx.layout.recipe_dir}") from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _result(name, "built", final, manifest)


def _result(name: str, outcome: str, path: Path, manifest: dict[str, Any]) -> TargetResult:
    validation = manifest.get("validation", {})
    return TargetResult(
        name,
        outcome,
        path,
        validation=validation.get("status"),
        message=validation.get("reason"),
        metrics=validation.get("metrics", {}),
    )
