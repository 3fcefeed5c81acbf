"""The builder interface every target family implements, and the shared build context."""

from __future__ import annotations

import json
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from pipeline.artifacts import Layout, build_lock
from pipeline.constants import (
    ENV_LLAMACPP,
    ENV_LLMCOMPRESSOR,
    ENV_MODELOPT,
    ENV_SGLANG,
    ENV_TRANSFORMERS,
    ENV_TRTLLM,
    ENV_VLLM,
    REFERENCE_KEY_FILE,
    STATUS_FAILED,
    STATUS_PASSED,
)
from pipeline.hashing import file_sha256, json_sha256
from pipeline.recipe import CalibrationOverride, Gates, LoadedRecipe, ServeSpec, TargetSpec
from pipeline.source import ResolvedSource
from pipeline.workers import run_worker

# Each environment's worker module, which answers the `toolchain` op.
ENV_WORKERS = {
    ENV_LLAMACPP: "pipeline.engines.llamacpp",
    ENV_TRANSFORMERS: "pipeline.engines.hf_reference",
    ENV_LLMCOMPRESSOR: "pipeline.engines.llmcompressor",
    ENV_VLLM: "pipeline.engines.vllm",
    ENV_SGLANG: "pipeline.engines.sglang",
    ENV_MODELOPT: "pipeline.engines.modelopt",
    ENV_TRTLLM: "pipeline.engines.trtllm",
}


class Reporter(Protocol):
    """Where the library reports progress; the CLI draws it, tests may ignore it."""

    def step(self, target: str, message: str) -> None: ...


class NullReporter:
    def step(self, target: str, message: str) -> None:
        pass


@dataclass
class BuildContext:
    """What every builder of one recipe shares: source, layout, caches of shared steps."""

    loaded: LoadedRecipe
    source_resolver: Callable[[], ResolvedSource]
    layout: Layout
    reporter: Reporter = field(default_factory=NullReporter)
    threads: int = 0  # 0: let the engine decide
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

    def worker(
        self, env: str, module: str, request: dict[str, Any], log: str, timeout_s: float | None = None
    ) -> dict[str, Any]:
        return run_worker(env, module, request, self.log_path(log), timeout_s)

    def toolchain(self, env: str) -> dict[str, Any]:
        """Versions in environment `env` (asked once per build)."""
        if env not in self._toolchains:
            self._toolchains[env] = self.worker(env, ENV_WORKERS[env], {"op": "toolchain"}, "toolchain")
        return self._toolchains[env]

    def reference(self) -> tuple[dict[str, Any], Path]:
        """The transformers reference on the source: computed once per inputs, cached on disk."""
        r = self.loaded.recipe
        eval_path = self.loaded.text_path(r.evaluation.text)
        key = json_sha256(
            {
                "source": self.source.sha256,
                "eval_text": file_sha256(eval_path),
                "evaluation": r.evaluation.model_dump(),
                "smoke": r.smoke.model_dump(),
                "toolchain": self.toolchain(ENV_TRANSFORMERS)["toolchain"],
            }
        )[:16]
        out = self.layout.reference_dir  # a fixed path: DVC's reference stage declares it
        with build_lock(self.layout, "reference", wait=True):
            self._compute_reference(out, key)
        if self._reference is None:
            self._reference = json.loads((out / "reference.json").read_text())
        return self._reference, out

    def _compute_reference(self, out: Path, key: str) -> None:
        r = self.loaded.recipe
        eval_path = self.loaded.text_path(r.evaluation.text)
        if not (out / "reference.json").is_file() or _read_text(out / REFERENCE_KEY_FILE) != key:
            self.reporter.step("reference", "computing the transformers reference")
            tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            with removed_on_error(tmp):
                result = self.worker(
                    ENV_TRANSFORMERS,
                    "pipeline.engines.hf_reference",
                    {
                        "op": "reference",
                        "model_dir": str(self.source.path),
                        "trust_remote_code": r.source.trust_remote_code,
                        "eval_text_path": str(eval_path),
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
                (tmp / REFERENCE_KEY_FILE).write_text(key)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
            self._reference = None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


@contextmanager
def removed_on_error(path: Path) -> Iterator[None]:
    """Remove a partial file or directory if the step writing it fails (disk full, crash)."""
    try:
        yield
    except BaseException:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        raise


def calibration_request(loaded: LoadedRecipe, override: CalibrationOverride) -> dict[str, Any]:
    """The calibration fields of a quantizer worker's request: the recipe's text with the
    target's own sample count / length (no text: nothing to calibrate, e.g. an FP16 engine)."""
    cal = loaded.recipe.calibration
    if cal is None:
        return {"text_path": None, "samples": 0, "seq_len": 0, "seed": 0}
    return {
        "text_path": str(loaded.text_path(cal.dataset)),
        "samples": override.samples or cal.samples,
        "seq_len": override.seq_len or cal.seq_len,
        "seed": cal.seed,
    }


def scored_metrics(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """The manifest's `validation.metrics` common to every engine, from an engine's scores."""
    return {
        "ppl": got["ppl"],
        "ppl_ref": ref["ppl"],
        "ppl_delta_pct": (got["ppl"] / ref["ppl"] - 1.0) * 100.0,
        "kld_mean": got["kld_mean"],
        "token_agreement": got["token_agreement"],
        "top1_agreement": got["top1_agreement"],
        "tokens_per_s": got["tokens_per_s"],
        "prompt_tokens_per_s": got["prompt_tokens_per_s"],
        "eval_tokens": len(ref["eval_ids"]),
    }


def gate(metrics: dict[str, Any], gates: Gates) -> tuple[str, str | None]:
    """(status, reason): perplexity and KLD gate; token agreement gates only if the recipe asks."""
    failures = []
    if metrics["ppl_delta_pct"] > gates.max_ppl_delta_pct:
        failures.append(f"ΔPPL {metrics['ppl_delta_pct']:.3f}% > {gates.max_ppl_delta_pct}%")
    if metrics["kld_mean"] > gates.max_kld_mean:
        failures.append(f"KLD {metrics['kld_mean']:.5f} > {gates.max_kld_mean}")
    if metrics["token_agreement"] < gates.min_token_agreement:
        failures.append(f"token agreement {metrics['token_agreement']:.2f} < {gates.min_token_agreement}")
    return (STATUS_FAILED, "; ".join(failures)) if failures else (STATUS_PASSED, None)


class TargetBuilder(ABC):
    """Build one target kind into a directory, then validate it in its serving engine."""

    kind: ClassVar[str]
    engine: ClassVar[str]  # the serving engine recorded in the manifest
    format: ClassVar[str]  # the artifact format recorded in the manifest
    environments: ClassVar[tuple[str, ...]]  # environments whose versions the manifest records
    gpu_host: ClassVar[bool] = False  # built only on GPU hosts (its DVC stages: gpu/dvc.yaml)

    def unavailable(self, ctx: BuildContext, name: str, spec: TargetSpec) -> str | None:
        """Why this host cannot build the target (its engine or GPU is missing), or None."""
        return None

    def plan(self, layout: Layout, name: str, spec: TargetSpec) -> dict[str, Any] | None:
        """What a dry run shows beyond the spec (commands, build configs), or None."""
        return None

    @abstractmethod
    def build(self, ctx: BuildContext, name: str, spec: TargetSpec, out: Path) -> dict[str, Any]:
        """Write the engine files into `out`; return manifest fields (quant, details; optionally
        gpu_arch and profile for `build`)."""

    @abstractmethod
    def validate(self, ctx: BuildContext, name: str, spec: TargetSpec, artifact: Path) -> dict[str, Any]:
        """Score the artifact in its engine; return the manifest's `validation` section."""

    @abstractmethod
    def serve_command(self, spec: TargetSpec, serve: ServeSpec) -> str:
        """The command a deploy job runs, with the recipe's serving knobs; ${ARTIFACT_DIR} stands
        for the artifact's directory and `python` for the serving environment's interpreter."""


BUILDERS: dict[str, TargetBuilder] = {}


def register(builder_cls: type[TargetBuilder]) -> type[TargetBuilder]:
    """Class decorator: make a builder available under its kind name."""
    BUILDERS[builder_cls.kind] = builder_cls()
    return builder_cls
