"""One recipe's project: the recipe, its artifact layout and the registry, and what the commands do
with them (build, the shared source and reference steps, the report). Commands are thin calls."""

from __future__ import annotations

import json
import shutil
import socket
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from pipeline.artifacts import (
    Layout,
    artifacts_root,
    build_lock,
    clone_file,
    file_entries,
    keep_version,
    publish,
    sweep_leftovers,
    verify_files,
    write_json_atomic,
)
from pipeline.constants import (
    ENV_GUIDELLM,
    MANIFEST_NAME,
    MANIFEST_SCHEMA,
    SERVING_METRICS,
    STATUS_PASSED,
    STATUS_UNAVAILABLE,
    serving_metrics_head,
)
from pipeline.context import BuildContext, NullReporter, Reporter
from pipeline.engines.serving import command_line
from pipeline.environments import environment_exists
from pipeline.errors import DiskFullError, PipelineError, RecipeError, RegistryError
from pipeline.hashing import file_sha256, json_sha256
from pipeline.manifest import (
    BuildInfo,
    Manifest,
    ServeInfo,
    StepRecord,
    Validation,
    read_manifest,
    write_manifest,
)
from pipeline.preflight import Host, Prediction, predict, unloadable
from pipeline.recipe import load_recipe, source_config
from pipeline.registry import Registry
from pipeline.serving import benchmark
from pipeline.source import resolve_source
from pipeline.spec import LoadedRecipe, workload_shape
from pipeline.targets import Target
from pipeline.targets.base import BuildOutput
from pipeline.texts import HF_PREFIX
from pipeline.workers.protocol import is_disk_full

# What `dvc metrics show` and the report list for each target (besides status, engine, size).
METRIC_COLUMNS = (
    "ppl", "ppl_ref", "ppl_delta_pct", "kld_mean", "kld_topk_mean", "token_agreement", "top1_agreement",
    "tokens_per_s",
)  # fmt: skip


@dataclass(frozen=True)
class TargetInputs:
    """What decides a target's artifact: the toolchain it records, its serve command, their hash."""

    toolchain: dict[str, Any]
    serve_command: str
    sha256: str
    bytes_sha256: str  # what decides the files alone (a part of sha256's inputs)


@dataclass
class TargetResult:
    """What happened to one target: built, up-to-date, planned, unavailable or error."""

    target: str
    outcome: str
    path: Path
    validation: str | None = None  # the primary engine's verdict
    engines: dict[str, str] = field(default_factory=dict)  # every engine's verdict
    message: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    exit_code: int = 0
    plan: dict[str, Any] | None = None  # dry runs: commands and configs the build would use
    host: str | None = None  # where it was built (cluster builds: the host and its Ray node)

    @property
    def failed(self) -> bool:
        """Built, and some engine's verdict is `failed` (the primary's or another's)."""
        return self.validation == "failed" or "failed" in self.engines.values()


@dataclass(frozen=True)
class Project:
    """A loaded recipe, where its artifacts live, and the registry that indexes them."""

    loaded: LoadedRecipe
    layout: Layout
    registry: Registry

    @classmethod
    def open(cls, recipe_path: str | Path, root: Path | None = None, files: bool = True) -> Project:
        """Load and check the recipe (a RecipeError names every problem); artifacts under `root`
        (default: PIPELINE_ARTIFACTS, else ./artifacts). `files` False: the files it names (source,
        texts) need not be on this host, for reading what another host built."""
        loaded = load_recipe(recipe_path, files=files)
        root = root or artifacts_root()
        return cls(loaded, Layout(root, loaded.recipe.name), Registry(root))

    def select(self, names: list[str] | None) -> dict[str, Target]:
        """The targets to build: all, or the named ones (unknown names are errors)."""
        targets: dict[str, Target] = dict(self.loaded.recipe.targets)  # type: ignore[arg-type]
        unknown = [n for n in names or [] if n not in targets]
        if unknown:
            raise RecipeError(
                f"unknown target(s) {', '.join(unknown)} in recipe {self.loaded.recipe.name!r} "
                f"(known: {', '.join(targets)})"
            )
        return {n: targets[n] for n in names} if names else targets

    def context(
        self, reporter: Reporter | None = None, threads: int = 0, node: str | None = None
    ) -> BuildContext:
        return BuildContext(
            loaded=self.loaded,
            source_resolver=lambda: resolve_source(self.loaded, self.layout.logs_dir / "source.log"),
            layout=self.layout,
            reporter=reporter or NullReporter(),
            threads=threads,
            node=node,
        )

    def preflight(self, host: Host, names: list[str] | None = None) -> list[Prediction]:
        """Whether each selected target's serving engines will load it on `host`, read from the
        source's config.json where it is known before the build (pipeline.preflight)."""
        config = source_config(self.loaded)
        return [
            predict(name, target, engine, host, config)
            for name, target in self.select(names).items()
            for engine in target.serving_engines()
        ]

    def plan(self, names: list[str] | None = None) -> list[TargetResult]:
        """What a build would do, without resolving the source or building anything."""
        return [
            TargetResult(
                name, "planned", self.layout.target_dir(name), message=spec.describe(),
                plan=spec.plan(self.layout, name),
            )
            for name, spec in self.select(names).items()
        ]  # fmt: skip

    def build(
        self,
        names: list[str] | None = None,
        *,
        force: bool = False,
        reporter: Reporter | None = None,
        threads: int = 0,
    ) -> list[TargetResult]:
        """Build the selected targets; one target's failure does not stop the others.

        A target whose engine this host lacks is `unavailable` (nothing built, nothing recorded).
        A full disk stops the build (every later target would fail the same way). The source is
        resolved when the first target needs it.
        """
        ctx = self.context(reporter, threads)
        sweep_leftovers(self.layout)  # what builds killed outright left behind
        results = []
        for name, spec in self.select(names).items():
            t0 = time.perf_counter()
            try:
                result = self._build_target(ctx, name, spec, force)
            except DiskFullError:
                raise
            except PipelineError as exc:
                result = TargetResult(
                    name, "error", self.layout.target_dir(name), message=str(exc), exit_code=exc.exit_code
                )
            result.seconds = time.perf_counter() - t0
            results.append(result)
        return results

    def prepare_source(self) -> Path:
        """Resolve the source and write its record (the DVC `source` stage's output)."""
        source = resolve_source(self.loaded, self.layout.logs_dir / "source.log")
        write_json_atomic(
            self.layout.source_record, {"recipe": self.loaded.recipe.name, "source": source.info}
        )
        return self.layout.source_record

    def prepare_reference(self, reporter: Reporter | None = None) -> Path:
        """Compute (or reuse) the transformers reference (the DVC `reference` stage's output)."""
        sweep_leftovers(self.layout)
        return self.context(reporter).reference()[1]

    def metrics_records(self) -> list[dict[str, Any]]:
        """Every target's metrics files as one list, read only (a target built on both hosts is a
        record each)."""
        rows = []
        for target in self.loaded.recipe.targets:
            for host in ("cpu", "gpu"):
                path = self.layout.metrics_path(target, gpu_host=host == "gpu")
                if path.is_file():
                    rows.append({"target": target, "host": host, **json.loads(path.read_text())})
        return rows

    def report(self) -> list[dict[str, Any]]:
        """Every target's metrics as one list, written as the DVC size-vs-ΔPPL scatter's data."""
        rows = self.metrics_records()
        # DVC's plot loader fails on the serving keys ("argument of type 'NoneType' is not
        # iterable", dvc 3.x): the scatter's file keeps the per-artifact columns only.
        plotted = [{k: v for k, v in row.items() if not k.startswith("serving_")} for row in rows]
        write_json_atomic(self.layout.report_path, plotted)
        return rows

    def _build_target(self, ctx: BuildContext, name: str, spec: Target, force: bool) -> TargetResult:
        reason = spec.unavailable(ctx, name)
        if reason is not None:
            final = self.layout.target_dir(name)
            return TargetResult(
                name, STATUS_UNAVAILABLE, final, validation=STATUS_UNAVAILABLE, message=reason
            )
        with build_lock(self.layout, name):
            return self._build_target_locked(ctx, name, spec, force)

    def _build_target_locked(self, ctx: BuildContext, name: str, spec: Target, force: bool) -> TargetResult:
        inputs = self.target_inputs(ctx, name, spec)
        old = None if force else self.current_manifest(name)
        damaged: list[str] = []
        outdated: str | None = None
        if old is not None and old.build.inputs_sha256 == inputs.sha256:
            # the bytes too (full sha256: ~10 s for 15 GB at 1.6 GB/s), or DVC would record them
            damaged = verify_files(self.layout.target_dir(name), old.files)
            outdated = None if damaged else _outdated_reference(ctx, old)
            if not damaged and outdated is None:
                return self.up_to_date(name, spec)
            why = outdated or f"the workspace artifact is damaged ({damaged[0]})"
            ctx.reporter.step(name, f"{why}: rebuilding it")
        self.check_loadable(ctx, name, spec)
        keep = None if damaged else self.keepable(name, spec, old, inputs)
        staging = self.layout.new_staging(name)
        try:
            manifest = self.make_artifact(ctx, name, spec, staging, inputs, keep=keep)
            result = self.record(name, spec, staging, manifest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if damaged or outdated:
            why = outdated or f"the workspace copy was damaged ({'; '.join(damaged)})"
            result.message = "; ".join(filter(None, [result.message, f"rebuilt: {why}"]))
        result.message = "; ".join(filter(None, [result.message, kept_note(manifest)]))
        return result

    def keepable(
        self, name: str, spec: Target, old: Manifest | None, inputs: TargetInputs
    ) -> Manifest | None:
        """The workspace artifact whose files a rebuild may keep: its files' own inputs are this
        build's (only serving knobs, the serving benchmark, gates or the reference moved) and its
        bytes are intact. On 2026-12-06 a changed benchmark time cap requantized a 7B GGUF on the
        device (its disk then ran out)."""
        if old is None or not spec.bytes_portable or old.build.bytes_sha256 != inputs.bytes_sha256:
            return None
        # same inputs: the caller has just verified the files (a rebuild for an outdated reference)
        if old.build.inputs_sha256 != inputs.sha256 and verify_files(self.layout.target_dir(name), old.files):
            return None
        return old

    def check_loadable(self, ctx: BuildContext, name: str, spec: Target) -> None:
        """RecipeError (exit 2) for a target none of its engines can load for a reason of the model
        and not of a host's hardware (pipeline.preflight: a split its heads do not allow), as
        `recipe check` says; raised before a build step runs, never for an up-to-date artifact."""
        refused = unloadable(list(ctx.preflight(name, spec, spec.serving_engines()).values()))
        if refused:
            raise RecipeError(f"{self.loaded.path}: {refused[0]}")

    def up_to_date(self, name: str, spec: Target) -> TargetResult:
        """The workspace artifact is what a build would make: (re-)register it, rewrite its metrics."""
        final = self.layout.target_dir(name)
        manifest = read_manifest(final)
        self.registry.register(final)
        self._write_metrics(name, manifest, spec.gpu_host)
        return _result(name, "up-to-date", final, manifest)

    def current_manifest(self, name: str) -> Manifest | None:
        """The manifest of the target's workspace artifact (None: none, another schema, damaged)."""
        final = self.layout.target_dir(name)
        if not (final / MANIFEST_NAME).is_file():
            return None
        try:
            return read_manifest(final)
        except RegistryError:
            return None  # another schema or a damaged manifest: rebuild

    def target_inputs(self, ctx: BuildContext, name: str, spec: Target) -> TargetInputs:
        """The toolchain, serve command and inputs hash a build of the target would record."""
        toolchain = {env: ctx.versions(env) for env in spec.recorded_environments()}
        if self.loaded.recipe.serving_benchmark.benchmarks(name) and environment_exists(ENV_GUIDELLM):
            toolchain[ENV_GUIDELLM] = ctx.versions(ENV_GUIDELLM)  # the load generator's numbers
        serve_command = spec.serve_command(ctx.serve(name))
        files_sha256 = bytes_sha256(ctx, name, spec, toolchain)  # once: it hashes a calibration text
        inputs = inputs_sha256(ctx, name, spec, toolchain, serve_command, files_sha256)
        return TargetInputs(toolchain, serve_command, inputs, files_sha256)

    def make_artifact(
        self,
        ctx: BuildContext,
        name: str,
        spec: Target,
        staging: Path,
        inputs: TargetInputs,
        keep: Manifest | None = None,
        keep_dir: Path | None = None,
    ) -> Manifest:
        """Build (or copy `keep`'s files from `keep_dir`, the workspace's target directory unless
        given: an earlier build of the same bytes' inputs), validate and benchmark the target into
        `staging`, and write its manifest there."""
        t0 = time.perf_counter()
        first_step = len(ctx.steps)
        try:
            if keep is None:
                ctx.reporter.step(name, "building")
                built = spec.build(ctx, name, staging)
            else:
                ctx.reporter.step(name, "keeping the earlier build's files (their inputs are unchanged)")
                built = _copy_files(keep_dir or self.layout.target_dir(name), keep, staging)
            build_s = time.perf_counter() - t0
            files = file_entries(staging)
            validation = spec.validate(ctx, name, staging)
            _record_preflight(validation, ctx.preflight(name, spec, spec.serving_engines()))
            weights = partial(spec.weights_read_per_token, ctx, name, staging)
            serving = benchmark(
                ctx, name, staging, validation, spec.serve_argv, weights_read=weights,
                other_argvs=spec.other_serve_argvs(),
            )  # fmt: skip
            manifest = Manifest(
                schema=MANIFEST_SCHEMA,
                recipe=self.loaded.recipe.name,
                recipe_sha256=self.loaded.sha256,
                recipe_path=str(self.loaded.path),
                target=name,
                kind=spec.kind,
                engine=spec.primary_engine(),
                format=spec.format,
                quant=built.quant,
                source=ctx.source.info,
                files=files,
                toolchain=inputs.toolchain,
                build=BuildInfo(
                    seconds=round(build_s, 2),
                    gpu_arch=built.gpu_arch,
                    profile=built.profile,
                    inputs_sha256=inputs.sha256,
                    finished_at=datetime.now(UTC).isoformat(timespec="seconds"),
                    host=socket.gethostname(),
                    node=ctx.node,
                    spec=spec.model_dump(exclude={"gates"}),
                    steps=[StepRecord(**vars(u)) for u in ctx.steps[first_step:]],
                    bytes_sha256=inputs.bytes_sha256,
                    bytes_from=None if keep is None else _provenance(keep),
                ),
                validation=validation,
                serve=ServeInfo(command=inputs.serve_command, tp_size=ctx.serve(name).tp_size),
                serving=serving,
                gguf=built.gguf,
                quantization=built.quantization,
                trtllm=built.trtllm,
            )
            write_manifest(staging, manifest)
        except OSError as exc:
            if is_disk_full(exc):
                raise DiskFullError(f"{name}: no space left on device in {staging.parent}") from None
            raise
        return manifest

    def record(self, name: str, spec: Target, staging: Path, manifest: Manifest) -> TargetResult:
        """Keep a complete artifact directory (`staging`, with its manifest) as the target's next
        version, publish it in the workspace unless it failed where a passing one is, register it
        (the registry's one writer) and write its metrics. `staging` is moved or left to delete."""
        final = self.layout.target_dir(name)
        try:
            _, kept = keep_version(staging, self.layout.versions_dir(name))
            # a failed build is a version of its own but never displaces a passing one
            replace = manifest.validation.status == STATUS_PASSED or not _passes(final)
            if replace:
                publish(staging, final)
            self.registry.add_version(kept, current=final if replace else None)
            if replace:
                self._write_metrics(name, manifest, spec.gpu_host)
        except OSError as exc:
            if is_disk_full(exc):
                raise DiskFullError(f"{name}: no space left on device in {self.layout.recipe_dir}") from None
            raise
        result = _result(name, "built", final if replace else kept, manifest)
        if not replace:
            result.message = (
                f"{result.message}; kept as version {kept.name} ({kept}); the workspace keeps the "
                "previous version, which passed"
            )
        return result

    def _write_metrics(self, target: str, manifest: Manifest, gpu_host: bool) -> None:
        """One target's numbers, for `dvc metrics show` and the recipe's report."""
        write_json_atomic(self.layout.metrics_path(target, gpu_host), metrics_record(manifest))


def metrics_record(manifest: Manifest) -> dict[str, Any]:
    """A target's metrics file (`dvc metrics show`, the report page) from its manifest."""
    v = manifest.validation
    m = v.metrics.model_dump() if v.metrics else {}
    record = {
        "status": v.status,
        "engine": manifest.engine,
        "quant": manifest.quant,
        "size_mib": round(manifest.size_bytes / 2**20, 2),
        "verdicts": {engine: verdict.status for engine, verdict in v.engines.items()},
        **{k: m.get(k) for k in METRIC_COLUMNS},
    }
    # the host's contention while the engines validated (tokens_per_s) and served (each level)
    shares = [s.others_cpu_share for s in manifest.build.steps if s.op == "validate"]
    record["tokens_per_s_others_cpu_share"] = max((x for x in shares if x is not None), default=None)
    if any(s.peak_gpu_mib is not None for s in manifest.build.steps):  # the report's build host
        record["host"] = "gpu"  # (a CPU host's records stay as they were: its own directory's)
    for engine, result in manifest.serving.items():
        record[f"serving_{engine}"] = result.status
        head = serving_metrics_head(engine, manifest.engine)
        record[f"{head}_device"] = result.device  # where it was measured: a GPU's name or cpu
        bound = result.decode_bound
        record[f"{head}_bound_share_c1"] = bound.share_c1 if bound else None
        if result.workload:
            record[f"{head}_workload"] = workload_shape(result.workload)
        for level in result.levels.values():
            for key in SERVING_METRICS:
                record[f"{head}_c{level.concurrency}_{key}"] = getattr(level, key)
        for run in result.more_workloads:  # keyed by their shape: serving_2048x256_c8_...
            prefix = f"{head}_{workload_shape(run.workload, 'x')}"
            for level in run.levels.values():
                for key in SERVING_METRICS:
                    record[f"{prefix}_c{level.concurrency}_{key}"] = getattr(level, key)
    return record


def inputs_sha256(
    ctx: BuildContext,
    name: str,
    spec: Target,
    toolchain: dict[str, Any],
    serve_command: str,
    files_sha256: str,
) -> str:
    """Everything that decides an artifact's bytes and its validation numbers: what decides the
    files (`files_sha256`, its bytes_sha256), the gates, the reference's inputs, the serve
    commands, the serving benchmark and every recorded environment's versions (the load
    generator's too)."""
    r = ctx.loaded.recipe
    bench = r.serving_benchmark
    benchmarked = bench.hashed() if bench.benchmarks(name) else None
    # the other engines' deploy commands: their serve checks and benchmarks run them (SGLang's
    # knobs for an AWQ/GPTQ checkpoint); none for a target served by one engine, whose hash stays
    others = {e: command_line(argv(ctx.serve(name))) for e, argv in spec.other_serve_argvs().items()}
    return json_sha256(
        {
            "schema": MANIFEST_SCHEMA,
            "target": name,
            # the spec without its gates, the source, the calibration and its text's contents, the
            # tensor-parallel split (before 2026-12-06 a calibration file edited in place, with
            # nothing else moved, left the target up to date)
            "bytes": files_sha256,
            "gates": spec.gates.model_dump(),
            "reference": ctx.reference_inputs(),
            "serve": serve_command,  # carries the recipe's serving knobs this target uses
            **({"other_serve": others} if others else {}),
            "serving_benchmark": benchmarked,
            "toolchain": toolchain,
        }
    )


def bytes_sha256(ctx: BuildContext, name: str, spec: Target, toolchain: dict[str, Any]) -> str:
    """What decides an artifact's files alone: the spec without its gates, the source, the
    calibration, the tensor-parallel split and the versions of the environments that build and
    score it (not the load generator's). The serve command, the serving benchmark and the reference
    decide only the numbers."""
    r = ctx.loaded.recipe
    cal = r.calibration
    # a local or built-in calibration text by its contents (a hub dataset's reference names its
    # revision): a file edited in place must not leave earlier quantized files kept
    text = None if cal is None or cal.dataset.startswith(HF_PREFIX) else ctx.loaded.text_path(cal.dataset)
    return json_sha256(
        {
            "schema": MANIFEST_SCHEMA,
            "target": name,
            "spec": spec.model_dump(exclude={"gates"}),
            "source": ctx.source.sha256,
            "calibration": cal.model_dump() if cal else None,
            "calibration_text": file_sha256(text) if text is not None and text.is_file() else None,
            "tp_size": ctx.serve(name).tp_size,
            "toolchain": {env: toolchain[env] for env in spec.recorded_environments()},
        }
    )


def _copy_files(final: Path, keep: Manifest, staging: Path) -> BuildOutput:
    """`keep`'s verified files, cloned from the workspace into `staging` (reflinks where the
    filesystem has them, else copies: a full copy needs the disk a rebuild's output would), and
    what its build handed the orchestrator."""
    for entry in keep.files:
        dest = staging / entry.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        clone_file(final / entry.path, dest)
    return BuildOutput(
        quant=keep.quant, gpu_arch=keep.build.gpu_arch, profile=keep.build.profile, gguf=keep.gguf,
        quantization=keep.quantization, trtllm=keep.trtllm,
    )  # fmt: skip


def kept_note(manifest: Manifest) -> str | None:
    """What a build that kept earlier files says about them (None: it made its own)."""
    made = manifest.build.bytes_from
    if made is None:
        return None
    return f"files kept from the build of {made['finished_at']} (only the numbers' inputs moved)"


def _provenance(keep: Manifest) -> dict[str, Any]:
    """Which build made the files a rebuild kept (`build.bytes_from`): the one `keep` names where
    it kept them in turn."""
    b = keep.build
    if b.bytes_from is not None:
        return b.bytes_from
    return {
        "inputs_sha256": b.inputs_sha256,
        "finished_at": b.finished_at,
        "host": b.host,
        "seconds": b.seconds,
    }


def _outdated_reference(ctx: BuildContext, old: Manifest) -> str | None:
    """Why an artifact's numbers are against another reference than this host's now (a bfloat16
    one made on a busy host, recomputed in float32 since), or None."""
    recorded = (old.validation.reference or {}).get("dtype")
    if recorded is None:  # no reference (nothing validated), or one made before placements
        return None
    now = (ctx.reference()[0].get("placement") or {}).get("dtype", "float32")
    if recorded == now:
        return None
    return f"validated against a {recorded} reference, which is {now} now"


def _passes(artifact_dir: Path) -> bool:
    """Whether a workspace directory holds an artifact whose validation passed."""
    try:
        return read_manifest(artifact_dir).validation.status == STATUS_PASSED
    except RegistryError:
        return False


def _record_preflight(validation: Validation, predicted: dict[str, Prediction]) -> None:
    """Each engine's preflight beside its verdict; a verdict that contradicts it says so: predicted
    not to load and passed (names the rule to correct), or predicted to load and failed before it
    scored anything (a crash or a server that never answered: maybe a rule the table lacks)."""
    for engine, verdict in validation.engines.items():
        p = predicted.get(engine)
        if p is None:
            continue
        record = p.record()
        if p.outcome == "fails" and verdict.status == STATUS_PASSED:
            record["contradicted"] = (
                f"preflight rule {p.rule} said {engine} {p.version} would not load it ({p.reason}), "
                "and it passed: correct the rule (pipeline/preflight.py)"
            )
        elif p.outcome == "loads" and verdict.status == "failed" and verdict.metrics is None:
            record["contradicted"] = (
                f"preflight said {engine} {p.version} would load it, and it failed before scoring "
                f"({verdict.reason}): if it could not load it, add a rule (pipeline/preflight.py)"
            )
        verdict.details["preflight"] = record


def _result(name: str, outcome: str, path: Path, manifest: Manifest) -> TargetResult:
    v = manifest.validation
    failed = [f"{e}: {x.reason}" for e, x in v.engines.items() if x.status == "failed" and e != v.engine]
    failed += [
        f"{e}: {x.details['preflight']['contradicted']}"
        for e, x in v.engines.items()
        if (x.details.get("preflight") or {}).get("contradicted")
    ]
    return TargetResult(
        name,
        outcome,
        path,
        validation=v.status,
        engines={engine: verdict.status for engine, verdict in v.engines.items()},
        message="; ".join(filter(None, [v.reason, *failed])) or None,
        metrics=v.metrics.model_dump() if v.metrics else {},
        host=_where(manifest),
    )


def _where(manifest: Manifest) -> str | None:
    """`host`, or `host (node <id>)` for a cluster build."""
    b = manifest.build
    return f"{b.host} (node {b.node[:12]})" if b.host and b.node else b.host
