"""The build context every target of one recipe build shares: the recipe, the resolved source,
the layout, the transformers reference, steps in environments and what they cost. Below the
target kinds and the engines, which take it as their first argument."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pipeline import preflight
from pipeline.artifacts import Layout, cached_step, read_key
from pipeline.constants import ENGINES, ENV_TRANSFORMERS
from pipeline.environments import (
    StepUsage,
    check_step_request,
    environment,
    environment_exists,
    run_step,
    worker_sources_sha256,
)
from pipeline.hashing import file_sha256, json_sha256
from pipeline.source import ResolvedSource, model_config
from pipeline.spec import CalibrationOverride, LoadedRecipe, ServeSpec, TargetSpec
from pipeline.workers.calibration import SELECTION_VERSION
from pipeline.workers.scoring import EVAL_CONVENTION


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
    _preflight: dict[str, dict[str, preflight.Prediction]] = field(default_factory=dict)

    @property
    def source(self) -> ResolvedSource:
        """The resolved source checkpoint (resolved, downloaded or materialised on first use)."""
        if self._source is None:
            self.reporter.step("source", "resolving source checkpoint")
            self._source = self.source_resolver()
        return self._source

    def log_path(self, name: str) -> Path:
        return self.layout.logs_dir / f"{name}.log"

    def serve(self, name: str) -> ServeSpec:
        """The serve knobs target `name` is validated and served with (the recipe's, with the
        target's own tp_size); the recipe's for a name that is not one of its targets."""
        r = self.loaded.recipe
        return r.targets[name].serve_spec(r.serve) if name in r.targets else r.serve

    def step(
        self, env: str, request: dict[str, Any], log: str, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Run one op of env's worker (pipeline.environments.run_step), logging to `<log>.log`;
        what it cost is appended to `steps`. The recipe's `step_limits_s` for the op beats
        `timeout_s`, which beats the op's default limit."""
        check_step_request(env, request)  # a misspelt or missing key fails here, naming it
        limit = self.loaded.recipe.step_limits_s.get(request.get("op", ""), timeout_s)
        return run_step(env, request, self.log_path(log), limit, on_usage=self.steps.append)

    def toolchain(self, env: str) -> dict[str, Any]:
        """What env's worker says of itself: `toolchain` (versions), sometimes `gpu`; asked once."""
        if env not in self._toolchains:
            reply = self.step(env, {"op": "toolchain"}, "toolchain")
            # the worker's own code beside the versions and lock: it decides the artifact's bytes too
            reply["toolchain"]["worker_sha256"] = worker_sources_sha256(environment(env).worker)
            self._toolchains[env] = reply
        return self._toolchains[env]

    def versions(self, env: str) -> dict[str, str | None]:
        return self.toolchain(env)["toolchain"]

    def program(self, env: str, name: str) -> str:
        """A deploy command's program as env's worker runs it here: `python` as it is (the worker
        runs its environment's interpreter), llama-server the build's own copy (its toolchain says
        where), any other from the PATH."""
        if name == "python":
            return name
        return (self.toolchain(env).get("programs") or {}).get(name, name)

    def preflight(
        self, name: str, target: TargetSpec, engines: tuple[str, ...]
    ) -> dict[str, preflight.Prediction]:
        """Whether each of `engines` will load target `name` on this host (pipeline.preflight):
        the versions its environments report where they exist, the project's pins elsewhere, the
        resolved source's config.json; once per target."""
        if name not in self._preflight:
            versions = {}
            for engine in engines:
                env = ENGINES[engine].env
                if environment_exists(env):
                    dists = preflight.ENGINE_DISTS[engine]
                    versions |= {d: v for d, v in self.versions(env).items() if v and d in dists}
            config = model_config(self.source.path / "config.json")
            host = preflight.host(versions=versions, tp_size=self.loaded.recipe.serve.tp_size)
            self._preflight[name] = {e: preflight.predict(name, target, e, host, config) for e in engines}
        return self._preflight[name]

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
            "convention": EVAL_CONVENTION,
            "calibration_selection": SELECTION_VERSION,  # the BOS framing of every quantizer's chunks
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
        cached_step(out, key, compute, self.layout.lock_path("reference"), self._reusable_reference)
        if self._reference is None:
            self._reference = json.loads((out / "reference.json").read_text())
        return self._reference, out

    def _reusable_reference(self, cached: Path) -> bool:
        """A cached reference made in bfloat16 (a busy host's placement) is recomputed once float32
        fits: the gates compare against the most exact reference the host can make. Judged once
        per build."""
        if self._reference is not None:
            return True
        dtype = (json.loads((cached / "reference.json").read_text()).get("placement") or {}).get("dtype")
        if dtype in (None, "float32"):  # None: made before placements were recorded (float32)
            return True
        now = self.step(
            ENV_TRANSFORMERS, {"op": "placement", "model_dir": str(self.source.path)}, "reference"
        )
        if now["placement"]["dtype"] != "float32":
            return True
        self.reporter.step("reference", f"the cached reference ran in {dtype}; float32 fits now: recomputing")
        return False

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
