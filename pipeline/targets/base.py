"""What every target kind is: one pydantic class holding its recipe spec and its behaviour (build,
validate, serve command, recipe-time checks), registered under its `kind` name; and the build
context the kinds share (source, reference, steps in environments)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar, get_args

from pydantic import model_validator

from pipeline.artifacts import Layout, cached_step, read_key
from pipeline.constants import ENGINE_KLD_METRIC, ENV_TRANSFORMERS, GPU_ARCHS, KLD_GATES
from pipeline.environments import StepUsage, run_step
from pipeline.hashing import file_sha256, json_sha256
from pipeline.manifest import Validation
from pipeline.recipe import CalibrationOverride, LoadedRecipe, ServeSpec, TargetSpec
from pipeline.source import ResolvedSource


class Reporter(Protocol):
    """Where the library reports progress; the CLI draws it, tests may ignore it."""

    def step(self, target: str, message: str) -> None: ...


class NullReporter:
    def step(self, target: str, message: str) -> None:
        pass


@dataclass
class BuildContext:
    """What every target of one recipe build shares: source, layout, the reference, environments."""

    loaded: LoadedRecipe
    source_resolver: Callable[[], ResolvedSource]
    layout: Layout
    reporter: Reporter = field(default_factory=NullReporter)
    threads: int = 0  # 0: let the engine decide
    node: str | None = None  # the Ray node building, in a cluster build (pipeline.cluster)
    steps: list[StepUsage] = field(default_factory=list)  # every step run so far, in order
    _toolchains: dict[str, dict[str, Any]] = field(default_factory=dict)
    _reference: dict[str, Any] | None = None
    _source: ResolvedSource | None = None

    @property
    def source(self) -> ResolvedSource:
        """The resolved source checkpoint (resolved, downloaded or materialised on first use)."""
        if self._source is None:
            self.reporter.step("source", "resolving source checkpoint")
            self._source = self.source_resolver()
        return self._source

    def log_path(self, name: str) -> Path:
        return self.layout.logs_dir / f"{name}.log"

    def step(
        self, env: str, request: dict[str, Any], log: str, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Run one op of env's worker (pipeline.environments.run_step), logging to `<log>.log`;
        what it cost is appended to `steps`. The recipe's `step_limits_s` for the op beats
        `timeout_s`, which beats the op's default limit."""
        limit = self.loaded.recipe.step_limits_s.get(request.get("op", ""), timeout_s)
        return run_step(env, request, self.log_path(log), limit, on_usage=self.steps.append)

    def toolchain(self, env: str) -> dict[str, Any]:
        """What env's worker says of itself: `toolchain` (versions), sometimes `gpu`; asked once."""
        if env not in self._toolchains:
            self._toolchains[env] = self.step(env, {"op": "toolchain"}, "toolchain")
        return self._toolchains[env]

    def versions(self, env: str) -> dict[str, str | None]:
        return self.toolchain(env)["toolchain"]

    def cached(self, name: str, inputs: dict[str, Any], produce: Callable[[Path], None]) -> Path:
        """`.cache/<name>/` computed by `produce` from `inputs` (pipeline.artifacts.cached_step)."""
        path = self.layout.cache_dir / name
        return cached_step(path, json_sha256(inputs), produce, self.layout.lock_path(f"cache-{name}"))

    def reference_inputs(self) -> dict[str, Any]:
        r = self.loaded.recipe
        return {
            "source": self.source.sha256,
            "eval_text": file_sha256(self.loaded.text_path(r.evaluation.text)),
            "evaluation": r.evaluation.model_dump(),
            "smoke": r.smoke.model_dump(),
            "toolchain": self.versions(ENV_TRANSFORMERS),
        }

    def reference(self) -> tuple[dict[str, Any], Path]:
        """The transformers reference on the source, in the fixed directory DVC's reference stage
        declares: computed once per inputs."""
        r = self.loaded.recipe
        out = self.layout.reference_dir

        def compute(tmp: Path) -> None:
            self.reporter.step("reference", "computing the transformers reference")
            result = self.step(
                ENV_TRANSFORMERS,
                {
                    "op": "reference",
                    "model_dir": str(self.source.path),
                    "trust_remote_code": r.source.trust_remote_code,
                    "eval_text_path": str(self.loaded.text_path(r.evaluation.text)),
                    "eval_tokens": r.evaluation.tokens,
                    "ctx": r.evaluation.ctx,
                    "prompts": r.smoke.prompts,
                    "max_new_tokens": r.smoke.max_new_tokens,
                    "chat": r.smoke.chat,
                    "out_dir": str(tmp),
                },
                "reference",
            )
            (tmp / "reference.json").write_text(json.dumps(result))

        key = self.reference_key()
        if read_key(out) != key:
            self._reference = None
        cached_step(out, key, compute, self.layout.lock_path("reference"))
        if self._reference is None:
            self._reference = json.loads((out / "reference.json").read_text())
        return self._reference, out

    def reference_key(self) -> str:
        """The hash of the reference's inputs (what its directory is recomputed on)."""
        return json_sha256(self.reference_inputs())

    def calibration_request(self, override: CalibrationOverride) -> dict[str, Any]:
        """The calibration fields of a quantizer's request: the recipe's text with the target's
        own sample count / length (no text: nothing to calibrate, e.g. an FP16 engine)."""
        cal = self.loaded.recipe.calibration
        if cal is None:
            return {"text_path": None, "samples": 0, "seq_len": 0, "seed": 0}
        return {
            "text_path": str(self.loaded.text_path(cal.dataset)),
            "samples": override.samples or cal.samples,
            "seq_len": override.seq_len or cal.seq_len,
            "seed": cal.seed,
        }


@dataclass(frozen=True)
class BuildOutput:
    """What a build step hands the orchestrator besides the files: the manifest's `quant`, the
    GPU and profile an engine was built for, and the kind's own record of how it was made."""

    quant: str
    gpu_arch: str | None = None
    profile: dict[str, Any] | None = None
    gguf: dict[str, Any] | None = None
    quantization: dict[str, Any] | None = None
    trtllm: dict[str, Any] | None = None


class Target(TargetSpec, ABC):
    """A target kind: its recipe fields (subclasses add a `kind` literal and options) and how it is
    built, validated in its serving engines and served."""

    engine: ClassVar[str]  # the primary serving engine (the manifest's `engine`)
    format: ClassVar[str]  # the artifact format recorded in the manifest
    environments: ClassVar[tuple[str, ...]]  # environments whose versions the manifest records
    gpu_host: ClassVar[bool] = False  # built only on GPU hosts (its DVC stages: gpu/dvc.yaml)

    def primary_engine(self) -> str:
        return self.engine

    def serving_engines(self) -> tuple[str, ...]:
        """Every engine that gives this artifact a verdict (the primary one first)."""
        return (self.primary_engine(),)

    def recorded_environments(self) -> tuple[str, ...]:
        """Environments whose versions decide the bytes and the numbers (the manifest's toolchain)."""
        return self.environments

    @model_validator(mode="after")
    def _kld_gates_match_engines(self) -> Target:
        """A KL gate must bound what the serving engines measure: a full-vocabulary KL and a top-k
        lower bound are different numbers (pipeline.workers.scoring)."""
        measured = {ENGINE_KLD_METRIC[e]: e for e in self.serving_engines()}
        for metric, gate in KLD_GATES.items():
            value = getattr(self.gates, gate)
            if metric in measured and value is None:
                raise ValueError(f"gates.{gate}: required, {measured[metric]} reports {metric}")
            if metric not in measured and value is not None:
                engines = ", ".join(self.serving_engines())
                use = ", ".join(KLD_GATES[m] for m in measured)
                raise ValueError(
                    f"gates.{gate}: the serving engines ({engines}) report {', '.join(measured)}, not "
                    f"{metric}; use {use} (pipeline.workers.scoring says what each measures)"
                )
        return self

    def build_gpu_arch(self) -> str | None:
        """The GPU architecture the build is tied to (an engine runs only where it was built)."""
        return None

    def unavailable(self, ctx: BuildContext, name: str) -> str | None:
        """Why this host cannot build the target (its engine or GPU is missing), or None."""
        return None

    def plan(self, layout: Layout, name: str) -> dict[str, Any] | None:
        """What a dry run shows beyond the spec (commands, build configs), or None."""
        return None

    def describe(self) -> str:
        fields = self.model_dump(exclude={"kind", "gates"})
        return f"{self.kind} " + " ".join(f"{k}={v}" for k, v in fields.items())

    @abstractmethod
    def build(self, ctx: BuildContext, name: str, out: Path) -> BuildOutput:
        """Write the artifact's files into `out`."""

    @abstractmethod
    def validate(self, ctx: BuildContext, name: str, artifact: Path) -> Validation:
        """Score the artifact in each of its serving engines against the reference."""

    @abstractmethod
    def serve_command(self, serve: ServeSpec) -> str:
        """The command a deploy job runs, with the recipe's serving knobs; ${ARTIFACT_DIR} stands
        for the artifact's directory and `python` for the serving environment's interpreter."""


def gpu_arch_number(arch: str) -> int:
    """sm90 -> 90."""
    return int(arch.removeprefix("sm"))


def known_gpu_arch(value: str) -> str:
    """A field validator: the GPU architectures an engine or FP8 checkpoint may target."""
    if value not in GPU_ARCHS:
        raise ValueError(f"unknown GPU architecture {value!r} (known: {', '.join(GPU_ARCHS)})")
    return value


KINDS: dict[str, type[Target]] = {}


K = TypeVar("K", bound=type[Target])


def register(cls: K) -> K:
    """Class decorator: make a kind known to the recipe loader and the builder under its name
    (the value of its `kind` literal)."""
    (kind,) = get_args(cls.model_fields["kind"].annotation)
    KINDS[kind] = cls
    return cls
