"""AWQ and GPTQ W4A16 targets for vLLM and SGLang: llm-compressor or GPTQModel quantizes; vLLM and
SGLang each give their own verdict (pipeline.engines).

Formats: llm-compressor writes compressed-tensors (pack-quantized), which vLLM loads natively (its
CPU int4 kernel here, Marlin on GPUs) and SGLang as `compressed-tensors`; GPTQModel writes its GPTQ
and AWQ GEMM formats, which both engines read from the checkpoint's quantization_config.
benchmarks/bench_quantizers.py compares the two backends on the same calibration.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from pipeline.constants import (
    ENGINE_SGLANG,
    ENGINE_VLLM,
    ENV_GPTQMODEL,
    ENV_LLMCOMPRESSOR,
    ENV_SGLANG,
    ENV_VLLM,
)
from pipeline.context import BuildContext
from pipeline.engines import sglang, vllm
from pipeline.engines.serving import ServeArgv
from pipeline.environments import environment_exists
from pipeline.hashing import file_sha256
from pipeline.manifest import Validation
from pipeline.spec import CalibrationOverride, ServeSpec
from pipeline.targets.base import BuildOutput, Target, register
from pipeline.validation import reference_record

QUANTIZE_TIMEOUT_S = 6 * 3600
QUANTIZATION = "compressed-tensors"  # vLLM's and SGLang's --quantization for llm-compressor's output
GROUP_SIZES = (128, 64, 32)
# backend -> (its environment, the distribution whose version the manifest's quantization names)
BACKENDS = {"llm-compressor": (ENV_LLMCOMPRESSOR, "llmcompressor"), "gptqmodel": (ENV_GPTQMODEL, "gptqmodel")}


class Int4Target(Target):
    """Common fields of the W4A16 checkpoints vLLM and SGLang serve (AWQ, GPTQ)."""

    bits: Literal[4] = 4
    group_size: Literal[-1, 32, 64, 128] = 128  # what vLLM's and SGLang's int4 kernels accept
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    dtype: Literal["float16", "bfloat16"] = "float16"  # activations, scales and unquantized layers
    symmetric: bool
    backend: Literal["llm-compressor", "gptqmodel"] = "llm-compressor"
    calibration: CalibrationOverride = CalibrationOverride()

    engine: ClassVar[str] = ENGINE_VLLM
    format: ClassVar[str] = "safetensors"
    environments: ClassVar[tuple[str, ...]] = (ENV_VLLM,)  # + the backend's (recorded_environments)

    @property
    def needs_calibration(self) -> bool:
        return True

    def serving_engines(self) -> tuple[str, ...]:
        return (ENGINE_VLLM, ENGINE_SGLANG)

    def recorded_environments(self) -> tuple[str, ...]:
        envs = (BACKENDS[self.backend][0], ENV_VLLM)
        return (*envs, ENV_SGLANG) if environment_exists(ENV_SGLANG) else envs

    @model_validator(mode="after")
    def _backend_supports(self) -> Int4Target:
        if self.backend == "gptqmodel" and self.ignore != ["lm_head"]:
            raise ValueError("backend gptqmodel keeps only lm_head unquantized: leave `ignore` out")
        return self

    @property
    def quantization(self) -> str | None:
        """vLLM's --quantization for this backend's output (None: read from its config)."""
        return QUANTIZATION if self.backend == "llm-compressor" else None

    @property
    def sglang_quantization(self) -> str | None:
        """SGLang's --quantization: as vLLM's. GPTQModel's formats are left to the checkpoint's
        config, as SGLang's docs ask for offline-quantized models: it converts them to its Marlin
        kernels only when the method is not named (`--quantization gptq` keeps the GPTQ kernel)."""
        return self.quantization

    def check(self, config: dict[str, Any] | None) -> list[str]:
        """The group size must divide every quantized layer's input size: say so now, not after
        hours of calibration (skipped while the model's config is unknown here)."""
        hidden = (config or {}).get("hidden_size")
        if config is None or not isinstance(hidden, int) or self.group_size <= 0:
            return []
        heads = config.get("num_attention_heads", 1)
        sizes = {
            "hidden_size": hidden,
            "intermediate_size": config.get("intermediate_size", hidden),
            "heads x head_dim": heads * config.get("head_dim", hidden // heads),
        }
        bad = {k: v for k, v in sizes.items() if v % self.group_size}
        if not bad:
            return []
        fits = [g for g in GROUP_SIZES if all(v % g == 0 for v in sizes.values())]
        why = ", ".join(f"{k} {v}" for k, v in bad.items())
        return [
            f"group_size: {self.group_size} does not divide the model's layer input sizes ({why}); "
            f"use {fits[0] if fits else -1}"
        ]

    def method_options(self) -> dict[str, Any]:
        """The method's own fields in the quantizer's request."""
        return {}

    def quantize_request(self, ctx: BuildContext, model_dir: Path, out: Path) -> dict[str, Any]:
        """The quantizer worker's request for this target (both backends take the same one)."""
        return {
            "op": "quantize",
            "method": self.kind,
            "model_dir": str(model_dir),
            "out_dir": str(out),
            "trust_remote_code": ctx.loaded.recipe.source.trust_remote_code,
            **ctx.calibration_request(self.calibration),
            "bits": self.bits,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "ignore": self.ignore,
            "dtype": self.dtype,
            **self.method_options(),
        }

    def build(self, ctx: BuildContext, name: str, out: Path) -> BuildOutput:
        request = self.quantize_request(ctx, ctx.source.path, out)
        ctx.reporter.step(name, f"{self.kind.upper()} calibration with {self.backend}")
        env, dist = BACKENDS[self.backend]
        result = ctx.step(env, request, name, timeout_s=QUANTIZE_TIMEOUT_S)
        qcfg = result["quantization_config"]
        cal = ctx.loaded.recipe.calibration
        assert cal is not None  # needs_calibration: the recipe schema requires it
        return BuildOutput(
            quant=f"{self.kind}-w{self.bits}a16-g{self.group_size}",
            quantization={
                "method": self.kind,
                "quant_method": qcfg.get("quant_method"),
                "format": qcfg.get("format"),
                "scheme": f"W{self.bits}A16 group {self.group_size} {'sym' if self.symmetric else 'asym'}",
                "activation_order": result.get("activation_order"),  # GPTQ's, as the checkpoint holds it
                "library": self.backend,
                "library_version": result["toolchain"][dist],
                "seconds": round(result["seconds"], 1),
                "device": result["device"],
                "calibration": {
                    "dataset": cal.dataset,
                    "dataset_sha256": file_sha256(Path(request["text_path"])),
                    "samples": result["chunks"],
                    "tokens": result["tokens"],
                    "seq_len": request["seq_len"],
                    "seed": cal.seed,
                },
                "vllm_quantization": qcfg.get("quant_method"),
                "sglang_quantization": self.sglang_quantization,
            },
        )

    def validate(self, ctx: BuildContext, name: str, artifact: Path) -> Validation:
        ref, _ = ctx.reference()
        predicted = ctx.preflight(name, self, self.serving_engines())
        verdicts = {
            ENGINE_VLLM: vllm.validate(
                ctx, name, artifact, self.dtype, self.gates, self.serve_argv, int4=True
            ),
            ENGINE_SGLANG: sglang.validate(
                ctx,
                name,
                artifact,
                self.sglang_quantization,
                self.dtype,
                self.gates,
                predicted[ENGINE_SGLANG],
            ),
        }
        return Validation.of(ENGINE_VLLM, verdicts, reference_record(ref))

    def serve_argv(self, serve: ServeSpec) -> list[str]:
        return vllm.serve_argv(serve, self.quantization, self.dtype)

    def other_serve_argvs(self) -> dict[str, ServeArgv]:
        """SGLang's deploy command, the one its serve check runs."""
        argv = partial(sglang.serve_argv, quantization=self.sglang_quantization, dtype=self.dtype)
        return {ENGINE_SGLANG: argv}


@register
class AwqTarget(Int4Target):
    """AWQ W4A16 (llm-compressor: compressed-tensors; `backend: gptqmodel`: AWQ GEMM format).

    ```yaml
    awq: {kind: awq, group_size: 64, n_grid: 20, gates: {max_ppl_delta_pct: 20, max_kld_topk_mean: 0.2}}
    ```
    """

    kind: Literal["awq"]
    symmetric: bool = False  # AWQ's classic zero-point scheme
    # scale grid search points (llm-compressor; GPTQModel searches its own fixed grid); fewer is
    # faster on CPU. llm-compressor's duo-scaling grid divides by n_grid - 2: below 3 it crashes.
    n_grid: int = Field(20, ge=3, le=100)

    def method_options(self) -> dict[str, Any]:
        return {"n_grid": self.n_grid}


@register
class GptqTarget(Int4Target):
    """GPTQ W4A16 (llm-compressor: compressed-tensors; `backend: gptqmodel`: GPTQ format).

    `act_order: static` (or `weight`, its llm-compressor alias) reorders columns at quantization
    time only; `group`/dynamic reordering is not offered because vLLM refuses it for grouped
    checkpoints. With `backend: gptqmodel` and groups it is GPTQModel's group-aware reordering
    (`act_group_aware`, which GPTQModel also applies when `act_order` is left out), never its
    `desc_act`, whose group indices vLLM 0.32 refuses (`group_size: -1`: `desc_act`, which changes
    no format there).

    ```yaml
    gptq: {kind: gptq, group_size: 64, gates: {max_ppl_delta_pct: 35, max_kld_topk_mean: 0.3}}
    ```
    """

    kind: Literal["gptq"]
    symmetric: bool = True  # vLLM's GPTQ kernels are symmetric-only
    act_order: Literal["static", "weight"] | None = None
    dampening_frac: float = Field(0.01, gt=0, lt=1)

    def method_options(self) -> dict[str, Any]:
        return {"act_order": self.act_order, "dampening_frac": self.dampening_frac}
