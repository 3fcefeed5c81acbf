"""Validation in SGLang (`sglang.Engine` in the `sglang` environment), then the manifest's
`sglang.launch_server` command served once: its own verdict, where that environment exists (GPU
build servers); `skipped` with the reason elsewhere."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from pipeline.constants import ENGINE_SGLANG, ENV_SGLANG
from pipeline.context import BuildContext
from pipeline.engines.serving import ARTIFACT_DIR, OfflineMode, command_line, serve_check
from pipeline.environments import environment
from pipeline.errors import EngineError
from pipeline.manifest import EngineVerdict
from pipeline.preflight import Prediction
from pipeline.spec import Gates, ServeSpec
from pipeline.validation import not_run, verdict

VALIDATE_TIMEOUT_S = 1800
EAGER_FLAG = "--disable-cuda-graph"  # the offline engine's mode (disable_cuda_graph), for the serve check
OFFLINE = OfflineMode("eager", (EAGER_FLAG,))


def serve_argv(serve: ServeSpec, quantization: str | None, dtype: str) -> list[str]:
    """The deploy command for a checkpoint in SGLang's server, with the recipe's knobs
    (quantization None: SGLang reads the method from the checkpoint's config)."""
    knobs = serve.sglang
    argv = ["python", "-m", "sglang.launch_server", "--model-path", ARTIFACT_DIR]
    argv += ["--quantization", quantization] if quantization else []
    argv += ["--dtype", dtype]
    argv += ["--host", serve.host, "--port", str(serve.port)]
    argv += ["--context-length", str(knobs.context_length)]
    argv += ["--mem-fraction-static", str(knobs.mem_fraction_static)]
    argv += ["--tp", str(serve.tp_size)] if serve.tp_size > 1 else []
    argv += ["--attention-backend", knobs.attention_backend] if knobs.attention_backend else []
    argv += [EAGER_FLAG] if knobs.disable_cuda_graph else []
    argv += ["--enable-mixed-chunk"] if knobs.enable_mixed_chunk else []
    return argv


def validate(
    ctx: BuildContext,
    name: str,
    artifact: Path,
    quantization: str | None,
    dtype: str,
    gates: Gates,
    predicted: Prediction | None = None,
) -> EngineVerdict:
    """SGLang's verdict; `skipped` without its environment, or where the preflight says this SGLang
    cannot load the checkpoint (`predicted`: pipeline.preflight), instead of minutes of JIT and a
    crash."""
    serve = ctx.serve(name)
    command = command_line(serve_argv(serve, quantization, dtype))
    details = {"quantization": quantization, "command": command}
    env = environment(ENV_SGLANG)
    if not env.exists:
        return not_run(
            "skipped",
            f"no SGLang environment ({env.interpreter} missing): set PIPELINE_SGLANG_PYTHON to an "
            "SGLang interpreter on a GPU host (PyPI's sglang is CUDA-only: its CPU kernel, sgl-kernel "
            "csrc/cpu, has no sdist or CPU wheel)",
            **details,
        )
    if predicted is not None and predicted.outcome == "fails":
        why = f"preflight: SGLang {predicted.version} will not load it: {predicted.reason} [{predicted.rule}]"
        return not_run("skipped", why, **details)
    ref, ref_dir = ctx.reference()
    ctx.reporter.step(name, "validating in SGLang")
    try:
        got = ctx.step(
            ENV_SGLANG,
            {
                "op": "validate",
                "model_dir": str(artifact),
                "quantization": quantization,
                "dtype": dtype,
                "reference": ref,
                "reference_dir": str(ref_dir),
                "max_new_tokens": ctx.loaded.recipe.smoke.max_new_tokens,
                "mem_fraction_static": serve.sglang.mem_fraction_static,
                "attention_backend": serve.sglang.attention_backend,
                "tp_size": serve.tp_size,
            },
            name,
            timeout_s=VALIDATE_TIMEOUT_S,
        )
        result = verdict(
            ctx, ENGINE_SGLANG, got, ref, gates, {"startup_s": got["startup_s"]},
            settings=got["settings"], device=got["device"], **details,
        )  # fmt: skip
        ctx.reporter.step(name, "serving once through sglang.launch_server")
        argv = partial(serve_argv, quantization=quantization, dtype=dtype)
        serve_check(ctx, ENV_SGLANG, name, artifact, argv, got, result, OFFLINE)
    except EngineError as exc:  # SGLang's crash is SGLang's verdict; the vLLM one still stands
        return not_run("failed", str(exc), **details)
    return result
