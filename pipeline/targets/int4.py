"""AWQ and GPTQ W4A16 targets for vLLM and SGLang: llm-compressor quantizes, vLLM validates.

Format choice: llm-compressor writes compressed-tensors (pack-quantized), which vLLM loads
natively (its CPU int4 kernel here, Marlin on GPUs) and SGLang loads as `compressed-tensors`.
One quantizer environment serves both methods.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.constants import (
    ENV_LLMCOMPRESSOR,
    ENV_SGLANG,
    ENV_VLLM,
    REFERENCE_KEY_FILE,
    STATUS_FAILED,
    STATUS_SKIPPED,
)
from pipeline.errors import EngineError
from pipeline.hashing import file_sha256, json_sha256
from pipeline.recipe import AwqTarget, GptqTarget, Int4Target, LoadedRecipe, ServeSpec, TargetSpec
from pipeline.targets.base import (
    BuildContext,
    TargetBuilder,
    calibration_request,
    gate,
    register,
    removed_on_error,
    scored_metrics,
)
from pipeline.workers import environment_exists, interpreter

LLMCOMPRESSOR = "pipeline.engines.llmcompressor"
VLLM = "pipeline.engines.vllm"
SGLANG = "pipeline.engines.sglang"
QUANTIZE_TIMEOUT_S = 6 * 3600
VALIDATE_TIMEOUT_S = 1800
SERVE_TIMEOUT_S = 900
QUANTIZATION = "compressed-tensors"  # what vLLM's and SGLang's --quantization say for these


class Int4Builder(TargetBuilder):
    engine = "vllm"
    format = "safetensors"
    environments = (ENV_LLMCOMPRESSOR, ENV_VLLM)

    def build(self, ctx: BuildContext, name: str, spec: TargetSpec, out: Path) -> dict[str, Any]:
        assert isinstance(spec, Int4Target)
        request = quantize_request(ctx.loaded, spec, ctx.source.path, out)
        cal = ctx.loaded.recipe.calibration
        assert cal is not None  # the recipe schema requires it
        text = Path(request["text_path"])
        ctx.reporter.step(name, f"{self.kind.upper()} calibration with llm-compressor")
        result = ctx.worker(ENV_LLMCOMPRESSOR, LLMCOMPRESSOR, request, name, timeout_s=QUANTIZE_TIMEOUT_S)
        qcfg = result["quantization_config"]
        return {
            "quant": self.quant_name(spec),
            "quantization": {
                "method": self.kind,
                "quant_method": qcfg.get("quant_method"),
                "format": qcfg.get("format"),
                "scheme": f"W{spec.bits}A16 group {spec.group_size} {'sym' if spec.symmetric else 'asym'}",
                "library": "llm-compressor",
                "library_version": result["toolchain"]["llmcompressor"],
                "seconds": round(result["seconds"], 1),
                "calibration": {
                    "dataset": cal.dataset,
                    "dataset_sha256": file_sha256(text),
                    "samples": result["chunks"],
                    "tokens": result["tokens"],
                    "seq_len": request["seq_len"],
                    "seed": cal.seed,
                },
                "vllm_quantization": qcfg.get("quant_method"),
                "sglang_quantization": QUANTIZATION,
            },
        }

    def quant_name(self, spec: Int4Target) -> str:
        return f"{self.kind}-w{spec.bits}a16-g{spec.group_size}"

    def validate(self, ctx: BuildContext, name: str, spec: TargetSpec, artifact: Path) -> dict[str, Any]:
        assert isinstance(spec, Int4Target)
        ref, ref_dir = ctx.reference()
        got, metrics, engine_ref = vllm_scores(ctx, name, artifact, spec.dtype)
        metrics["startup_s"] = got["startup_s"]
        ctx.reporter.step(name, "serving once through vLLM's OpenAI server")
        serve = ctx.worker(
            ENV_VLLM,
            VLLM,
            {
                "op": "serve_check",
                "model_dir": str(artifact),
                "command": self.serve_command(spec, ctx.loaded.recipe.serve),
                "prompt_ids": ref["generations"][0]["prompt_ids"],
                "expected_text": got["generations"][0]["text"],
                "ready_timeout_s": SERVE_TIMEOUT_S - 60,
            },
            name,
            timeout_s=SERVE_TIMEOUT_S,
        )
        status, reason = gate(metrics, spec.gates)
        if not serve["ok"]:
            status = STATUS_FAILED
            reason = (
                f"OpenAI server answered {serve['text']!r}, expected to start {serve['expected_prefix']!r}"
            )
        return {
            "status": status,
            "reason": reason,
            "engine": "vllm",
            "metrics": metrics,
            "gates": spec.gates.model_dump(),
            "generations": got["generations"],
            "engine_env": got["engine_env"],
            "engine_quantization": got["quantization"],
            "engine_reference": {
                "ppl": engine_ref["ppl"],
                "dtype": spec.dtype,
                "kld_mean": engine_ref["kld_mean"],
            },
            "serve_check": serve,
            "reference": {"engine": "transformers", "toolchain": ref["toolchain"], "dtype": "float32"},
            "sglang": _sglang_validation(ctx, name, spec, artifact, ref, ref_dir),
        }

    def serve_command(self, spec: TargetSpec, serve: ServeSpec) -> str:
        assert isinstance(spec, Int4Target)
        knobs = serve.vllm
        batched = (
            f" --max-num-batched-tokens {knobs.max_num_batched_tokens}"
            if knobs.max_num_batched_tokens
            else ""
        )
        return (
            "python -m vllm.entrypoints.openai.api_server --model ${ARTIFACT_DIR} "
            f"--quantization {QUANTIZATION} --dtype {spec.dtype} --host {serve.host} "
            f"--port {serve.port} --max-model-len {knobs.max_model_len} "
            f"--gpu-memory-utilization {knobs.gpu_memory_utilization}"
            f"{batched}"
        )


def quantize_request(loaded: LoadedRecipe, spec: Int4Target, model_dir: Path, out: Path) -> dict[str, Any]:
    """The llm-compressor worker's request for one target (also what the benchmark runs)."""
    options: dict[str, Any] = {}
    if isinstance(spec, AwqTarget):
        options = {"n_grid": spec.n_grid}
    elif isinstance(spec, GptqTarget):
        options = {"act_order": spec.act_order, "dampening_frac": spec.dampening_frac}
    return {
        "op": "quantize",
        "method": spec.kind,
        "model_dir": str(model_dir),
        "out_dir": str(out),
        "trust_remote_code": loaded.recipe.source.trust_remote_code,
        **calibration_request(loaded, spec.calibration),
        "bits": spec.bits,
        "group_size": spec.group_size,
        "symmetric": spec.symmetric,
        "ignore": spec.ignore,
        "dtype": spec.dtype,
        **options,
    }


def _sglang_validation(
    ctx: BuildContext, name: str, spec: Int4Target, artifact: Path, ref: dict[str, Any], ref_dir: Path
) -> dict[str, Any]:
    """SGLang's own verdict where its environment exists (GPU build servers); `skipped` here."""
    serve = ctx.loaded.recipe.serve
    record: dict[str, Any] = {
        "quantization": QUANTIZATION,
        "command": "python -m sglang.launch_server --model-path ${ARTIFACT_DIR} "
        f"--quantization {QUANTIZATION} --dtype {spec.dtype} --host {serve.host} --port {serve.port} "
        f"--context-length {serve.sglang.context_length} "
        f"--mem-fraction-static {serve.sglang.mem_fraction_static}",
    }
    if not environment_exists(ENV_SGLANG):
        return {
            **record,
            "status": STATUS_SKIPPED,
            "reason": f"no SGLang environment ({interpreter(ENV_SGLANG)} missing): PyPI's sglang is "
            "CUDA-only and its CPU kernel (sgl-kernel csrc/cpu) has no sdist or CPU wheel on PyPI; "
            "validate on a GPU build server",
        }
    ctx.reporter.step(name, "validating in SGLang")
    try:
        got = ctx.worker(
            ENV_SGLANG,
            SGLANG,
            {
                "op": "validate",
                "model_dir": str(artifact),
                "quantization": QUANTIZATION,
                "dtype": spec.dtype,
                "reference": ref,
                "reference_dir": str(ref_dir),
                "max_new_tokens": ctx.loaded.recipe.smoke.max_new_tokens,
            },
            name,
            timeout_s=VALIDATE_TIMEOUT_S,
        )
    except EngineError as exc:
        return {**record, "status": STATUS_FAILED, "reason": str(exc)}
    metrics = {**got, "ppl_ref": ref["ppl"], "ppl_delta_pct": (got["ppl"] / ref["ppl"] - 1.0) * 100.0}
    status, reason = gate(metrics, spec.gates)
    return {**record, "status": status, "reason": reason, "metrics": metrics}


def vllm_scores(
    ctx: BuildContext, name: str, artifact: Path, dtype: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Score a checkpoint in vLLM next to the unquantized source scored in vLLM too (engine
    noise vs quantization loss): (vLLM's result, the manifest metrics, the engine reference)."""
    ref, ref_dir = ctx.reference()
    engine_ref = vllm_reference(ctx, ref, ref_dir, dtype)
    ctx.reporter.step(name, "validating in vLLM")
    got = vllm_validate(ctx, name, str(artifact), ref, ref_dir, dtype)
    metrics = {
        **scored_metrics(got, ref),
        "ppl_engine_ref": engine_ref["ppl"],
        "ppl_delta_vs_engine_ref_pct": (got["ppl"] / engine_ref["ppl"] - 1.0) * 100.0,
        "kld_method": got["kld_method"],
    }
    return got, metrics, engine_ref


def vllm_validate(
    ctx: BuildContext, log: str, model_dir: str, ref: dict[str, Any], ref_dir: Path, dtype: str
) -> dict[str, Any]:
    return ctx.worker(
        ENV_VLLM,
        VLLM,
        {
            "op": "validate",
            "model_dir": model_dir,
            "dtype": dtype,
            "reference": ref,
            "reference_dir": str(ref_dir),
            "max_new_tokens": ctx.loaded.recipe.smoke.max_new_tokens,
        },
        log,
        timeout_s=VALIDATE_TIMEOUT_S,
    )


def vllm_reference(ctx: BuildContext, ref: dict[str, Any], ref_dir: Path, dtype: str) -> dict[str, Any]:
    """The unquantized source scored in vLLM (cached): separates engine noise from quantization."""
    ref_key = (ref_dir / REFERENCE_KEY_FILE).read_text()
    key = json_sha256({"ref": ref_key, "dtype": dtype, "tc": ctx.toolchain(ENV_VLLM)})[:16]
    path = ctx.layout.cache_dir / f"vllm-reference-{key}.json"
    if not path.is_file():
        ctx.reporter.step("reference", "scoring the unquantized source in vLLM")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with removed_on_error(tmp):
            result = vllm_validate(ctx, "vllm-reference", str(ctx.source.path), ref, ref_dir, dtype)
            tmp.write_text(json.dumps(result))
        tmp.rename(path)
    return json.loads(path.read_text())


@register
class AwqBuilder(Int4Builder):
    kind = "awq"


@register
class GptqBuilder(Int4Builder):
    kind = "gptq"
