"""The `pipeline` command: thin Typer commands over library functions; errors become exit codes."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline.artifacts import artifacts_root, iter_artifacts
from pipeline.constants import STATUS_UNAVAILABLE
from pipeline.environments import ENVIRONMENTS, locked_environments, run_step
from pipeline.errors import EngineError, PipelineError, RecipeError, RegistryError, ValidationFailed
from pipeline.manifest import Manifest, read_manifest
from pipeline.preflight import Host, Prediction, engine_versions, unloadable
from pipeline.preflight import as_json as preflight_json
from pipeline.preflight import host as preflight_host
from pipeline.project import Project, TargetResult
from pipeline.registry import KEEP_VERSIONS, Registry, VersionEntry
from pipeline.report import report_rows, write_html
from pipeline.selection import OBJECTIVES, Scenario, select
from pipeline.spec import NAME

app = typer.Typer(
    help="Build, validate and record LLM deployment artifacts from one recipe.", no_args_is_help=True
)
recipe_app = typer.Typer(help="Recipe commands.", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

T = TypeVar("T")
RecipeArg = Annotated[Path, typer.Argument(help="Recipe YAML file.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _run(fn: Callable[[], T]) -> T:
    """Call library code; a PipelineError becomes one line on stderr and its exit code."""
    try:
        return fn()
    except PipelineError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None


def _target_names(targets: str | None) -> list[str] | None:
    """--targets as a list (None: all); a list naming no target, or an empty name, is an error."""
    if targets is None:
        return None
    names = [t.strip() for t in targets.split(",")]
    if not all(names):
        raise RecipeError(f"--targets {targets!r}: an empty target name (leave --targets out for all)")
    return names


def _artifact_dir(artifact: str) -> Path:
    """RECIPE/TARGET under the artifacts root; anything else (a path, `..`) is refused."""
    parts = artifact.split("/")
    if len(parts) != 2 or not all(NAME.match(p) for p in parts):
        raise RegistryError(f"{artifact!r}: expected RECIPE/TARGET (lowercase names, no path)")
    return artifacts_root() / parts[0] / parts[1]


class _RichReporter:
    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task = progress.add_task("starting", total=None)

    def step(self, target: str, message: str) -> None:
        self.progress.update(self.task, description=f"[bold]{target}[/]: {message}")


@app.command()
def build(
    recipe: RecipeArg,
    targets: Annotated[str | None, typer.Option(help="Comma-separated target names (default: all).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the recipe and show the plan.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if up to date.")] = False,
    threads: Annotated[int, typer.Option(help="Threads for llama.cpp (0: all cores).")] = 0,
    require_all: Annotated[
        bool,
        typer.Option(
            "--require-all", help="Fail (exit 5) when a target's engine is unavailable on this host."
        ),
    ] = False,
    cluster: Annotated[
        str | None,
        typer.Option(
            envvar="PIPELINE_CLUSTER",
            help="Build on a Ray cluster: its address, `auto` (this host's `ray start` cluster) or "
            "`local` (one started in this process). The artifacts root must be on storage every "
            "node mounts at the same path.",
        ),
    ] = None,
) -> None:
    """Build, validate and publish a recipe's artifacts.

    A target whose engine this host lacks (TensorRT-LLM without it or its GPU) is reported
    `unavailable` with the reason and does not fail the build, unless --require-all. With
    --cluster, a target no node of the cluster can build is the one `unavailable`.
    """
    names = _run(lambda: _target_names(targets))
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err, transient=True
    ) as progress:
        reporter = _RichReporter(progress)
        project = _run(lambda: Project.open(recipe))
        results = _run(
            lambda: (
                project.plan(names) if dry_run else _build(project, names, force, reporter, threads, cluster)
            )
        )
    out.print(_summary(results))
    for r in results:
        if r.plan:
            out.print(f"[bold]{r.target}[/] plan:", highlight=False)
            out.print_json(json.dumps(r.plan))
    if dry_run:
        host = preflight_host(tp_size=project.loaded.recipe.serve.tp_size)
        _print_preflight(project.preflight(host, names), host)
    errors = [r for r in results if r.outcome == "error"]
    unavailable = [r for r in results if r.outcome == STATUS_UNAVAILABLE]
    for r in unavailable:
        err.print(f"[yellow]unavailable:[/] {r.target}: {escape(str(r.message))}",
                  highlight=False, soft_wrap=True)  # fmt: skip
    failed = [r for r in results if r.failed]
    for r in errors:
        err.print(f"[bold red]error:[/] {r.target}: {escape(str(r.message))}",
                  highlight=False, soft_wrap=True)  # fmt: skip
    if errors:
        raise typer.Exit(max(r.exit_code for r in errors))
    if failed:
        for r in failed:
            err.print(f"[bold red]failed:[/] {r.target}: {escape(str(r.message))}",
                      highlight=False, soft_wrap=True)  # fmt: skip
        err.print(f"[bold red]error:[/] validation failed for {', '.join(r.target for r in failed)}")
        raise typer.Exit(ValidationFailed.exit_code)
    if unavailable and require_all:
        names = ", ".join(r.target for r in unavailable)
        err.print(f"[bold red]error:[/] --require-all: {names} unavailable on this host")
        raise typer.Exit(EngineError.exit_code)


def _build(
    project: Project, names: list[str] | None, force: bool, reporter: _RichReporter, threads: int,
    cluster: str | None,
) -> list[TargetResult]:  # fmt: skip
    if not cluster:
        return project.build(names, force=force, reporter=reporter, threads=threads)
    from pipeline.cluster import build_on_cluster  # Ray is imported only for cluster builds

    return build_on_cluster(project, cluster, names, force=force, reporter=reporter, threads=threads)


@app.command()
def source(recipe: RecipeArg) -> None:
    """Resolve and hash the recipe's source checkpoint; write its record (a DVC stage)."""
    path = _run(lambda: Project.open(recipe).prepare_source())
    out.print(f"source record: {path}", highlight=False)


@app.command()
def reference(recipe: RecipeArg) -> None:
    """Compute the transformers reference every target is validated against (a DVC stage)."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), console=err, transient=True) as progress:
        path = _run(lambda: Project.open(recipe).prepare_reference(_RichReporter(progress)))
    out.print(f"reference: {path}", highlight=False)


@app.command()
def report(
    recipe: RecipeArg,
    as_json: JsonOpt = False,
    html: Annotated[
        Path | None, typer.Option("--html", help="Also write one self-contained page: table and plots.")
    ] = None,
    beside: Annotated[
        list[Path] | None,
        typer.Option("--beside", help="Another recipe whose rows the page and --json show too (repeatable)."),
    ] = None,
    beside_artifacts: Annotated[
        Path | None,
        typer.Option(help="The --beside recipes' artifacts (default: PIPELINE_ARTIFACTS or ./artifacts)."),
    ] = None,
) -> None:
    """Every built target's validation numbers in one table (and the DVC size-vs-ΔPPL data)."""
    # the metrics files alone: a recipe built on another host (its source there) reports here too
    project = _run(lambda: Project.open(recipe, files=False))
    others = _run(lambda: _beside_records(beside or [], beside_artifacts))
    rows = _run(project.report)
    shown = [(project.loaded.recipe.name, rows), *others]
    if others:  # each row names its recipe
        rows = [{"recipe": name, **r} for name, records in shown for r in records]
    if html is not None:
        title = shown[0][0] + (f" beside {', '.join(n for n, _ in others)}" if others else "")
        named = [row for name, records in shown for row in report_rows(records, name if others else None)]
        page = _run(lambda: write_html(title, named, html))
        err.print(f"report page: {page}", highlight=False)
    if as_json:
        out.print_json(json.dumps(rows))
        return
    table = Table(title=f"report {recipe}")
    for col in ("target", "engine", "quant", "status", "MiB", "ΔPPL %", "KLD", "KLD top-k ≥", TOKENS_PER_S):
        table.add_column(col)
    for r in rows:
        table.add_row(
            f"{r['recipe']}: {r['target']}" if others else r["target"],
            r["engine"],
            r["quant"],
            r["status"] or "-",
            _fmt(r["size_mib"], ".1f"),
            _fmt(r["ppl_delta_pct"], "+.2f"),
            _fmt(r["kld_mean"], ".4f"),
            _fmt(r["kld_topk_mean"], ".4f"),
            _fmt(r["tokens_per_s"], ".0f"),
        )
    out.print(table)
    out.print(KLD_NOTE, highlight=False)


def _beside_records(paths: list[Path], root: Path | None) -> list[tuple[str, list[dict[str, Any]]]]:
    """Each --beside recipe's name and metrics records under `root`; one without any is an error (a
    wrong --beside-artifacts, most likely: never a page silently without it)."""
    shown = []
    for path in paths:
        other = Project.open(path, root, files=False)
        name, records = other.loaded.recipe.name, other.metrics_records()
        if not records:
            raise PipelineError(
                f"--beside {path}: no target of {name} has metrics under {root or artifacts_root()}"
            )
        shown.append((name, records))
    return shown


# What the speed and KL columns mean (pipeline.workers.scoring has the definitions).
TOKENS_PER_S = "tok/s (1 stream)"
KLD_NOTE = (
    "KLD: full-vocabulary KL to the fp32 reference (llama.cpp, TensorRT-LLM); KLD top-k ≥: its lower "
    "bound from the engine's top-64 logprobs (vLLM, SGLang). tok/s: smoke prompts one at a time, "
    "generated tokens / wall seconds, prefill included."
)


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _summary(results: list[TargetResult]) -> Table:
    table = Table(title="build summary")
    columns = ("target", "outcome", "validation", "ΔPPL %", "KLD", "KLD top-k ≥", "agree", TOKENS_PER_S)
    on_nodes = any(r.host and "(node " in r.host for r in results)  # a cluster build: say where
    for col in (*columns, "time", *(("built on",) if on_nodes else ()), "note"):
        table.add_column(col)
    for r in results:
        m = r.metrics
        colour = {"passed": "green", "failed": "red"}.get(r.validation or "", "yellow")
        note = "" if r.outcome == STATUS_UNAVAILABLE else escape(r.message or "")  # said in full below
        verdicts = " ".join(f"{e}:{s}" for e, s in r.engines.items()) if len(r.engines) > 1 else ""
        table.add_row(
            r.target,
            r.outcome,
            f"[{colour}]{r.validation or '-'}[/]" + (f" ({verdicts})" if verdicts else ""),
            _fmt(m.get("ppl_delta_pct"), "+.2f"),
            _fmt(m.get("kld_mean"), ".4f"),
            _fmt(m.get("kld_topk_mean"), ".4f"),
            _fmt(m.get("token_agreement"), ".2f"),
            _fmt(m.get("tokens_per_s"), ".0f"),
            f"{r.seconds:.0f}s",
            *((r.host or "-",) if on_nodes else ()),
            note,
        )
    return table


GpuArchOpt = Annotated[
    str | None,
    typer.Option("--gpu-arch", help="Predict for this GPU (sm80, sm89, sm90, ...; default: this host's)."),
]
EngineVersionOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--engine-version",
        help="ENGINE=VERSION to predict for (repeatable; e.g. sglang=0.5.17; default: the project's pins).",
    ),
]
TpSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--tp-size",
        min=1,
        help="Tensor-parallel size (default: the recipe's serve.tp_size; a target's own tp_size wins).",
    ),
]


def _host(gpu_arch: str | None, engine_version: list[str] | None, tp_size: int) -> Host:
    """The host a prediction is for (pipeline.preflight.host); bad values are recipe errors."""
    try:
        return preflight_host(gpu_arch, engine_versions(engine_version or []), tp_size)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None


def _print_preflight(predictions: list[Prediction], host: Host) -> None:
    out.print(f"preflight ({host.describe()}):", highlight=False)
    for p in predictions:
        colour = {"loads": "green", "fails": "red", "unknown": "yellow"}[p.outcome]
        out.print(f"  [{colour}]{escape(p.line())}[/]", highlight=False, soft_wrap=True)


@recipe_app.command("check")
def recipe_check(
    recipe: RecipeArg,
    gpu_arch: GpuArchOpt = None,
    engine_version: EngineVersionOpt = None,
    tp_size: TpSizeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Validate a recipe (schema, values, referenced files) and predict whether each target's
    serving engines will load it (engine version, GPU architecture, tensor-parallel size), without
    building. A target that none of its engines can load is a recipe error (exit 2)."""
    project = _run(lambda: Project.open(recipe))
    tp = tp_size or project.loaded.recipe.serve.tp_size
    host = _run(lambda: _host(gpu_arch, engine_version, tp))
    predictions = project.preflight(host)
    r = project.loaded.recipe
    if as_json:
        out.print_json(preflight_json(predictions, host))
    else:
        targets = ", ".join(f"{n} ({t.kind})" for n, t in r.targets.items())
        out.print(f"ok: {project.loaded.path}: recipe {r.name!r}, {len(r.targets)} targets: {targets}",
                  highlight=False)  # fmt: skip
        _print_preflight(predictions, host)
    problems = unloadable(predictions)
    if problems:
        _run(lambda: _raise(RecipeError(f"{project.loaded.path}: {'; '.join(problems)}")))


def _raise(exc: PipelineError) -> None:
    raise exc


@app.command("list")
def list_artifacts(as_json: JsonOpt = False) -> None:
    """List published artifacts and their validation status."""
    rows = _run(lambda: list(iter_artifacts(artifacts_root())))
    if as_json:
        out.print_json(json.dumps([{"path": str(d), **_brief(m)} for d, m in rows]))
        return
    table = Table(title=f"artifacts in {artifacts_root()}")
    for col in ("recipe", "target", "engine", "quant", "validation", "ΔPPL %", "KLD", "KLD top-k ≥", "MiB"):
        table.add_column(col)
    for _, m in rows:
        b = _brief(m)
        table.add_row(
            b["recipe"],
            b["target"],
            b["engine"],
            b["quant"],
            b["validation"],
            _fmt(b["ppl_delta_pct"], "+.2f"),
            _fmt(b["kld_mean"], ".4f"),
            _fmt(b["kld_topk_mean"], ".4f"),
            f"{b['bytes'] / 2**20:.0f}",
        )
    out.print(table)


def _brief(m: Manifest) -> dict[str, Any]:
    metrics = m.validation.metrics
    return {
        "recipe": m.recipe,
        "target": m.target,
        "engine": m.engine,
        "quant": m.quant,
        "validation": m.validation.status,
        "engines": {e: v.status for e, v in m.validation.engines.items()},
        "ppl_delta_pct": metrics.ppl_delta_pct if metrics else None,
        "kld_mean": metrics.kld_mean if metrics else None,
        "kld_topk_mean": metrics.kld_topk_mean if metrics else None,
        "bytes": m.size_bytes,
    }


@app.command()
def show(artifact: Annotated[str, typer.Argument(help="RECIPE/TARGET")], as_json: JsonOpt = False) -> None:
    """Show one artifact's manifest."""
    manifest = _run(lambda: read_manifest(_artifact_dir(artifact)))
    if as_json:
        out.print_json(manifest.to_json())
        return
    v = manifest.validation
    out.print(f"[bold]{manifest.recipe}/{manifest.target}[/] {manifest.engine} {manifest.quant}")
    for engine, verdict in v.engines.items():
        reason = f" ({verdict.reason})" if verdict.reason else ""
        out.print(f"validation in {engine}: {verdict.status}{escape(reason)}", highlight=False)
        for key, value in (verdict.metrics.model_dump() if verdict.metrics else {}).items():
            out.print(f"  {key}: {value}")
    out.print(f"source: {manifest.source}")
    for env, versions in manifest.toolchain.items():
        out.print(f"toolchain {env}: {versions}", highlight=False)
    for f in manifest.files:
        out.print(f"  {f.path}  {f.bytes} bytes  sha256 {f.sha256[:16]}…")
    out.print(f"serve: {manifest.serve.command}")


cluster_app = typer.Typer(help="Ray cluster commands (`pipeline build --cluster`).", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("resources")
def cluster_resources(
    slots: Annotated[int, typer.Option(min=1, help="Builds this node runs at once.")] = 1,
) -> None:
    """This host's Ray custom resources as JSON, for `ray start --resources`: its step
    environments, its GPU architecture and its build slots (pipeline.cluster)."""
    from pipeline.cluster import node_resources

    typer.echo(json.dumps(node_resources(slots)))  # plain: it goes into `ray start --resources`


registry_app = typer.Typer(
    help="Query the artifact registry (deploy jobs script these).", no_args_is_help=True
)
app.add_typer(registry_app, name="registry")
RefArg = Annotated[str, typer.Argument(help="RECIPE/TARGET")]
VersionOpt = Annotated[
    int | None, typer.Option("--version", help="A version number (default: the current one).")
]


def _registry() -> Registry:
    return Registry(artifacts_root())


def _emit(data: Any, as_json: bool) -> None:
    if as_json:
        out.print_json(json.dumps(data))
    else:
        out.print(data)


@registry_app.command("list")
def registry_list(
    all_: Annotated[
        bool, typer.Option("--all", help="Include artifacts whose validation did not pass.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Every target's current version (validated ones unless --all)."""
    _version_table(_run(lambda: _registry().entries(include_failed=all_)), as_json)


@registry_app.command("history")
def registry_history(ref: RefArg, as_json: JsonOpt = False) -> None:
    """Every kept version of one target, oldest first, with its stages."""
    _version_table(_run(lambda: _registry().history(ref)), as_json)


def _version_table(entries: list[VersionEntry], as_json: bool) -> None:
    if as_json:
        _emit([e.model_dump(mode="json") for e in entries], True)
        return
    table = Table(title=f"registry {_registry().path}")
    for col in ("recipe", "target", "version", "engine", "quant", "gpu", "status", "verdicts", "stages"):
        table.add_column(col)
    for e in entries:
        table.add_row(
            e.recipe,
            e.target,
            f"{e.version}{' (current)' if e.current else ''}",
            e.engine,
            e.quant,
            e.gpu_arch or "-",
            e.status,
            " ".join(f"{engine}:{v.status}" for engine, v in e.engines.items()),
            ",".join(e.stages),
        )
    out.print(table)


@registry_app.command("show")
def registry_show(ref: RefArg, version: VersionOpt = None, as_json: JsonOpt = False) -> None:
    """One version's registered manifest (default: the current version)."""
    _emit(_run(lambda: _registry().show(ref, version)), as_json)


GpusOpt = Annotated[
    int | None, typer.Option("--gpus", min=1, help="The deploy host's GPU count: nothing sharded over more.")
]


@registry_app.command("resolve")
def registry_resolve(
    model: Annotated[str, typer.Option("--model", help="Recipe name, e.g. qwen2-7b.")],
    engine: Annotated[str, typer.Option("--engine", help="llama.cpp, vllm, ...")],
    quant: Annotated[str, typer.Option("--quant", help="Q4_0, awq-w4a16-g64, ...")],
    gpu_arch: Annotated[str | None, typer.Option("--gpu-arch", help="e.g. sm90")] = None,
    stage: Annotated[str | None, typer.Option("--stage", help="dev, staging or prod")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Also match artifacts that did not pass.")] = False,
    engine_version: Annotated[
        str | None, typer.Option(help="Version of the engine that built it, e.g. TensorRT-LLM 1.2.0.")
    ] = None,
    gpus: GpusOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Exactly one version: where its bytes are (path, DVC location), files with sha256, serve command."""
    _emit(
        _run(lambda: _registry().resolve(model, engine, quant, gpu_arch, stage, all_, engine_version, gpus)),
        as_json,
    )


@registry_app.command("select")
def registry_select(
    model: Annotated[str | None, typer.Option("--model", help="Recipe name (default: every model).")] = None,
    cpu: Annotated[bool, typer.Option("--cpu", help="A CPU host: engines validated on a CPU only.")] = False,
    gpu_arch: Annotated[str | None, typer.Option("--gpu-arch", help="A GPU host, e.g. sm90.")] = None,
    gpus: GpusOpt = None,
    memory_gib: Annotated[
        float | None, typer.Option("--memory-gib", help="Memory the job has (on a GPU host: each GPU's).")
    ] = None,
    max_ppl_delta: Annotated[float | None, typer.Option("--max-ppl-delta", help="ΔPPL %, at most.")] = None,
    max_ttft_ms: Annotated[float | None, typer.Option("--max-ttft-ms", help="TTFT p99, at most.")] = None,
    max_itl_ms: Annotated[float | None, typer.Option("--max-itl-ms", help="ITL p99, at most.")] = None,
    concurrency: Annotated[
        int, typer.Option("--concurrency", min=1, help="Where latency and throughput are read.")
    ] = 1,
    workload: Annotated[
        str | None,
        typer.Option("--workload", help="Serving numbers at PROMPT/OUTPUT tokens (default: the first)."),
    ] = None,
    objective: Annotated[
        str, typer.Option("--objective", help=f"What ranks first: {'|'.join(OBJECTIVES)}.")
    ] = "accuracy",
    as_json: JsonOpt = False,
) -> None:
    """The validated artifacts that fit a scenario, best first, with the measured reason for each
    (and why every other one is excluded)."""
    scenario = Scenario(
        model=model,
        cpu=cpu,
        gpu_arch=gpu_arch,
        gpus=gpus,
        memory_gib=memory_gib,
        max_ppl_delta=max_ppl_delta,
        max_ttft_ms=max_ttft_ms,
        max_itl_ms=max_itl_ms,
        concurrency=concurrency,
        workload=workload,
        objective=objective,  # type: ignore[arg-type]  # checked by select
    )
    answer = _run(lambda: select(_registry(), scenario))
    if as_json:
        _emit(answer, True)
        return
    for rank, c in enumerate(answer["ranked"], 1):
        out.print(
            f"{rank}. {c['recipe']}/{c['target']} v{c['version']} in {c['engine']} ({c['quant']}): "
            + "; ".join(c["reasons"]),
            highlight=False,
        )
    if not answer["ranked"]:
        out.print("no artifact fits this scenario", highlight=False)
    for c in answer["excluded"]:
        out.print(
            f"   excluded {c['recipe']}/{c['target']} in {c['engine']}: {c['excluded']}", highlight=False
        )
    if not answer["ranked"]:
        raise typer.Exit(1)


@registry_app.command("verify")
def registry_verify(
    ref: Annotated[str, typer.Argument(help="RECIPE/TARGET, or the directory of a fetched artifact.")],
    manifest_sha256: Annotated[
        str | None, typer.Option(help="Expected manifest sha256 (from resolve) for a fetched directory.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-hash an artifact's files against its manifest; non-zero exit when anything differs."""
    problems = _run(lambda: _registry().verify(ref, manifest_sha256))
    _emit({"artifact": ref, "ok": not problems, "problems": problems}, as_json)
    if problems:
        raise typer.Exit(RegistryError.exit_code)


@registry_app.command("promote")
def registry_promote(
    ref: RefArg,
    stage: Annotated[str, typer.Option("--stage", help="dev, staging or prod")],
    version: VersionOpt = None,
    local: Annotated[
        bool, typer.Option("--local", help="Allow a version only this host can serve (no DVC coordinates).")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Point a stage at one validated, intact version; it stays there until the next promote."""
    _emit(_run(lambda: _registry().promote(ref, stage, version, local)), as_json)


@registry_app.command("gc")
def registry_gc(
    keep: Annotated[
        int, typer.Option(help="Newest versions kept per target, beside current and staged ones.")
    ] = (KEEP_VERSIONS),
    as_json: JsonOpt = False,
) -> None:
    """Delete kept versions beyond the policy (never the current or a staged one)."""
    _emit(_run(lambda: _registry().gc(keep)), as_json)


@registry_app.command("rebuild")
def registry_rebuild(as_json: JsonOpt = False) -> None:
    """Recreate the index from the manifests on disk and the stages from the promote journals."""
    done = _run(lambda: _registry().rebuild())
    _emit({"registered": done.targets, "lost_stages": done.lost_stages}, as_json)
    if done.lost_stages:  # the index is rebuilt; these stages point nowhere now: say so, fail
        err.print(f"[bold red]error:[/] stages not recovered: {'; '.join(done.lost_stages)}", highlight=False)
        raise typer.Exit(RegistryError.exit_code)


@app.command("env")
def env_status(
    as_json: JsonOpt = False,
    names: Annotated[
        bool, typer.Option("--names", help="Only the names of the tool environments installed here.")
    ] = False,
) -> None:
    """Show each step environment: its interpreter and tool versions (or why it is unusable)."""
    if names:
        for env in locked_environments():
            out.print(env.name, highlight=False)
        return
    status: dict[str, Any] = {}
    log = artifacts_root() / ".logs" / "env.log"
    for name, env in ENVIRONMENTS.items():
        entry: dict[str, Any] = {"purpose": env.purpose, "python": env.interpreter, "gpu_only": env.gpu_only}
        if env.gpu_only and not env.exists:
            entry["status"] = "absent (GPU build servers only)"
        else:
            try:
                entry.update(run_step(name, {"op": "toolchain"}, log))
                entry["status"] = "ok"
            except PipelineError as exc:
                entry["status"] = f"unusable: {exc}"
        status[name] = entry
    if as_json:
        out.print_json(json.dumps(status))
        return
    for env, entry in status.items():
        out.print(f"[bold]{env}[/] ({entry['purpose']}): {entry['status']}", highlight=False)
        out.print(f"  python: {entry['python']}")
        for tool, ver in entry.get("toolchain", {}).items():
            out.print(f"  {tool}: {ver}", highlight=False)
    if any(e["status"].startswith("unusable") for e in status.values()):
        raise typer.Exit(5)


if __name__ == "__main__":
    app()
