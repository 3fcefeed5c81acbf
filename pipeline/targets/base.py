"""What every target kind is: one pydantic class holding its recipe spec and its behaviour (build,
validate, serve command, recipe-time checks), registered under its `kind` name in
pipeline.spec.KINDS. The build context the kinds share is pipeline.context."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar, get_args

from pydantic import model_validator

from pipeline.artifacts import Layout
from pipeline.constants import ENGINES, GPU_ARCHS, KLD_GATES
from pipeline.context import BuildContext
from pipeline.decode_bound import checkpoint_weights_read
from pipeline.engines.serving import ServeArgv, command_line
from pipeline.manifest import Validation
from pipeline.spec import KINDS, ServeSpec, TargetSpec


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
    # whether a rebuild whose bytes' inputs are unchanged (only serving or validation inputs moved)
    # may keep the earlier build's files: not for an engine compiled for the GPU it was built on
    bytes_portable: ClassVar[bool] = True

    def primary_engine(self) -> str:
        return self.engine

    def serving_engines(self) -> tuple[str, ...]:
        """Every engine that gives this artifact a verdict (the primary one first)."""
        return (self.primary_engine(),)

    def other_serve_argvs(self) -> dict[str, ServeArgv]:
        """The deploy command of each serving engine but the primary one (whose command is
        serve_argv, the manifest's serve.command): what the serving benchmark runs with
        `engines: all`. Empty by default."""
        return {}

    def recorded_environments(self) -> tuple[str, ...]:
        """Environments whose versions decide the bytes and the numbers (the manifest's toolchain)."""
        return self.environments

    @model_validator(mode="after")
    def _kld_gates_match_engines(self) -> Target:
        """A KL gate must bound what the serving engines measure: a full-vocabulary KL and a top-k
        lower bound are different numbers (pipeline.workers.scoring)."""
        measured = {ENGINES[e].kld_metric: e for e in self.serving_engines()}
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
    def serve_argv(self, serve: ServeSpec) -> list[str]:
        """The command a deploy job runs, as an argument list, with the recipe's serving knobs;
        ${ARTIFACT_DIR} stands for the artifact's directory and `python` for the serving
        environment's interpreter. The serve check and the serving benchmark run it with another
        `serve` (a loopback host, a free port): nothing patches a command afterwards."""

    def weights_read_per_token(self, ctx: BuildContext, name: str, artifact: Path) -> int:
        """Bytes of weights one decoded token reads (pipeline.decode_bound), from the checkpoint's
        safetensors headers; a kind with other files reads its own."""
        return checkpoint_weights_read(artifact)

    def serve_command(self, serve: ServeSpec) -> str:
        """The manifest's `serve.command`: serve_argv, every value shell-quoted (command_line)."""
        return command_line(self.serve_argv(serve))


def gpu_arch_number(arch: str) -> int:
    """sm90 -> 90."""
    return int(arch.removeprefix("sm"))


def known_gpu_arch(value: str) -> str:
    """A field validator: the GPU architectures an engine or FP8 checkpoint may target."""
    if value not in GPU_ARCHS:
        raise ValueError(f"unknown GPU architecture {value!r} (known: {', '.join(GPU_ARCHS)})")
    return value


K = TypeVar("K", bound=type[Target])


def register(cls: K) -> K:
    """Class decorator: make a kind known to the recipe loader and the builder under its name
    (the value of its `kind` literal)."""
    (kind,) = get_args(cls.model_fields["kind"].annotation)
    KINDS[kind] = cls
    return cls
