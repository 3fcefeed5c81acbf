"""TensorRT-LLM engines (FP16/BF16, INT8 SmoothQuant or weight-only, FP8) for one GPU architecture
and one fixed profile, in two steps and two environments:

1. checkpoint (`modelopt` environment): ModelOpt calibrates on the recipe's calibration text and
   writes a TensorRT-LLM checkpoint (`config.json` + `rank<N>.safetensors`);
2. engine (`trtllm` environment: NVIDIA's TensorRT-LLM 1.2 container or a build server's venv,
   1.2 being the last release line with the TensorRT engine backend): `trtllm-build`, then
   validation in the TensorRT-LLM runtime.

Where TensorRT-LLM or a GPU of the target's architecture is missing (every CPU machine), the
target is reported `unavailable` with the reason: nothing is built, nothing is recorded.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.artifacts import Layout
from pipeline.constants import ENGINE_TRTLLM, ENV_MODELOPT, ENV_TRTLLM
from pipeline.context import BuildContext
from pipeline.engines.serving import ARTIFACT_DIR
from pipeline.environments import environment
from pipeline.errors import BuildError, EngineError
from pipeline.hashing import file_sha256
from pipeline.manifest import Validation
from pipeline.spec import CalibrationOverride, ServeSpec, Strict
from pipeline.targets.base import BuildOutput, Target, gpu_arch_number, known_gpu_arch, register
from pipeline.targets.modelopt import checkpoint_request
from pipeline.validation import not_run, reference_record, verdict
from pipeline.workers.calibration import SELECTION_VERSION

TRTLLM_RELEASE_LINE = "1.2."  # the engine backend and trtllm-build were removed after 1.2
CHECKPOINT_TIMEOUT_S = 6 * 3600
ENGINE_TIMEOUT_S = 6 * 3600
VALIDATE_TIMEOUT_S = 3600
CHECKPOINT_INFO = "pipeline-checkpoint.json"
TOKENIZER_DIR = "tokenizer"  # beside the engine files: what the runtime and trtllm-serve read
TOKENIZER_FILE_PREFIXES = ("tokenizer", "special_tokens")
TOKENIZER_FILES = ("config.json", "generation_config.json", "chat_template.jinja")
# recipe quant -> the checkpoint's `quantization.quant_algo` (TensorRT-LLM QuantAlgo names)
QUANT_ALGO = {"fp16": None, "bf16": None, "int8_sq": "W8A8_SQ_PER_CHANNEL", "int8_wo": "W8A16", "fp8": "FP8"}


class TrtllmPlugins(Strict):
    """trtllm-build plugin switches (TensorRT-LLM 1.2 flag names; `auto` follows the dtype)."""

    gpt_attention_plugin: Literal["auto", "float16", "bfloat16", "float32", "disable"] = "auto"
    gemm_plugin: Literal["auto", "float16", "bfloat16", "float32", "fp8", "disable"] = "auto"
    context_fmha: bool = True
    use_fp8_context_fmha: bool = False
    remove_input_padding: bool = True
    use_paged_context_fmha: bool = False


class TrtllmProfile(Strict):
    """The fixed shapes a TensorRT-LLM engine is compiled for.

    ```yaml
    profile: {max_batch_size: 8, max_input_len: 2048, max_seq_len: 4096, max_num_tokens: 8192}
    ```
    """

    max_batch_size: int = Field(8, ge=1, le=4096)
    max_input_len: int = Field(1024, ge=1)
    max_seq_len: int = Field(2048, ge=2)
    max_num_tokens: int = Field(8192, ge=1)
    opt_num_tokens: int | None = Field(None, ge=1)
    kv_cache_type: Literal["paged", "continuous", "disabled"] = "paged"
    plugins: TrtllmPlugins = TrtllmPlugins()

    @model_validator(mode="after")
    def _shapes(self) -> TrtllmProfile:
        if self.max_input_len > self.max_seq_len:
            raise ValueError(f"max_input_len {self.max_input_len} > max_seq_len {self.max_seq_len}")
        if self.opt_num_tokens is not None and self.opt_num_tokens > self.max_num_tokens:
            raise ValueError(f"opt_num_tokens {self.opt_num_tokens} > max_num_tokens {self.max_num_tokens}")
        if self.max_num_tokens < self.max_input_len and not self.plugins.use_paged_context_fmha:
            raise ValueError(
                f"max_num_tokens {self.max_num_tokens} < max_input_len {self.max_input_len}: one "
                "prompt must fit in a step unless plugins.use_paged_context_fmha (context chunking)"
            )
        return self


def export_dtype(spec: TrtllmTarget) -> str:
    return {"fp16": "float16", "bf16": "bfloat16"}.get(spec.quant, spec.dtype)


def checkpoint_dir(layout: Layout, name: str) -> Path:
    return layout.cache_dir / f"trtllm-checkpoint-{name}"


def engine_dir(layout: Layout, name: str) -> Path:
    return layout.cache_dir / f"trtllm-engine-{name}"


def check_checkpoint_config(spec: TrtllmTarget, config: dict[str, Any]) -> list[str]:
    """Where a written TensorRT-LLM checkpoint's config.json differs from what the recipe asked."""
    problems = []
    quant = config.get("quantization") or {}
    if quant.get("quant_algo") != QUANT_ALGO[spec.quant]:
        problems.append(f"quant_algo {quant.get('quant_algo')} != {QUANT_ALGO[spec.quant]}")
    want_kv = "FP8" if spec.kv_cache_dtype == "fp8" else None
    if quant.get("kv_cache_quant_algo") != want_kv:
        problems.append(f"kv_cache_quant_algo {quant.get('kv_cache_quant_algo')} != {want_kv}")
    if config.get("dtype") != export_dtype(spec):
        problems.append(f"dtype {config.get('dtype')} != {export_dtype(spec)}")
    tp = (config.get("mapping") or {}).get("tp_size")
    if tp != spec.tp_size:
        problems.append(f"mapping.tp_size {tp} != {spec.tp_size}")
    return problems


def build_config(spec: TrtllmTarget) -> dict[str, Any]:
    """The BuildConfig fields this target sets (what the engine's config.json `build_config` holds)."""
    p = spec.profile
    plugins = p.plugins
    return {
        "max_batch_size": p.max_batch_size,
        "max_input_len": p.max_input_len,
        "max_seq_len": p.max_seq_len,
        "max_num_tokens": p.max_num_tokens,
        "opt_num_tokens": p.opt_num_tokens,
        "max_beam_width": 1,
        "kv_cache_type": p.kv_cache_type,
        "gather_context_logits": spec.gather_context_logits,
        "plugin_config": {
            "gpt_attention_plugin": plugins.gpt_attention_plugin,
            "gemm_plugin": plugins.gemm_plugin,
            "context_fmha": plugins.context_fmha,
            "use_fp8_context_fmha": plugins.use_fp8_context_fmha,
            "remove_input_padding": plugins.remove_input_padding,
            "use_paged_context_fmha": plugins.use_paged_context_fmha,
        },
    }


def trtllm_build_argv(spec: TrtllmTarget, checkpoint: Path, output: Path) -> list[str]:
    """The exact `trtllm-build` command line (TensorRT-LLM 1.2 flag names) for one target."""
    p = spec.profile
    plugins = p.plugins

    def on_off(flag: bool) -> str:
        return "enable" if flag else "disable"

    argv = [
        "trtllm-build",
        "--checkpoint_dir", str(checkpoint),
        "--output_dir", str(output),
        "--max_batch_size", str(p.max_batch_size),
        "--max_input_len", str(p.max_input_len),
        "--max_seq_len", str(p.max_seq_len),
        "--max_num_tokens", str(p.max_num_tokens),
        "--max_beam_width", "1",
        "--kv_cache_type", p.kv_cache_type,
        "--gpt_attention_plugin", plugins.gpt_attention_plugin,
        "--gemm_plugin", plugins.gemm_plugin,
        "--context_fmha", on_off(plugins.context_fmha),
        "--remove_input_padding", on_off(plugins.remove_input_padding),
        "--use_paged_context_fmha", on_off(plugins.use_paged_context_fmha),
        "--use_fp8_context_fmha", on_off(plugins.use_fp8_context_fmha),
        "--workers", str(spec.tp_size),
    ]  # fmt: skip
    if p.opt_num_tokens is not None:
        argv += ["--opt_num_tokens", str(p.opt_num_tokens)]
    if spec.gather_context_logits:
        argv.append("--gather_context_logits")
    return argv


def engine_config_mismatches(spec: TrtllmTarget, engine_config: dict[str, Any]) -> list[str]:
    """Where the built engine's config.json `build_config` differs from the planned profile."""
    got = engine_config.get("build_config") or {}
    want = build_config(spec)
    keys = ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "gather_context_logits")
    problems = [f"{k} {got.get(k)} != {want[k]}" for k in keys if got.get(k) != want[k]]
    kv = str(got.get("kv_cache_type", "")).lower().removeprefix("kvcachetype.")
    if kv and kv != spec.profile.kv_cache_type:
        problems.append(f"kv_cache_type {kv} != {spec.profile.kv_cache_type}")
    return problems


@register
class TrtllmTarget(Target):
    """A TensorRT-LLM 1.2 engine for one GPU architecture and one fixed profile: a ModelOpt
    checkpoint step (FP16 unquantized, INT8 SmoothQuant or weight-only, FP8), then `trtllm-build`.

    ```yaml
    trtllm-fp8: {kind: trtllm, quant: fp8, gpu_arch: sm90, gpu_memory_gib: 80,
                 profile: {max_batch_size: 8, max_input_len: 2048, max_seq_len: 4096},
                 gates: {max_ppl_delta_pct: 2, max_kld_mean: 0.02}}
    ```
    """

    kind: Literal["trtllm"]
    quant: Literal["fp16", "bf16", "int8_sq", "int8_wo", "fp8"]
    gpu_arch: str
    gpu_memory_gib: float | None = Field(None, gt=0)  # checked against weights + KV cache
    tp_size: int = Field(1, ge=1, le=64)
    dtype: Literal["float16", "bfloat16"] = "float16"  # activations and unquantized layers
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    smoothquant_alpha: float = Field(0.5, ge=0, le=1)  # int8_sq only
    gather_context_logits: bool = True  # validation's perplexity needs it; costs engine memory
    profile: TrtllmProfile = TrtllmProfile()
    calibration: CalibrationOverride = CalibrationOverride()

    engine: ClassVar[str] = ENGINE_TRTLLM
    format: ClassVar[str] = "tensorrt-engine"
    environments: ClassVar[tuple[str, ...]] = (ENV_MODELOPT, ENV_TRTLLM)
    bytes_portable: ClassVar[bool] = False  # an engine is compiled for its build host's GPU
    gpu_host: ClassVar[bool] = True

    _arch = field_validator("gpu_arch")(known_gpu_arch)

    @model_validator(mode="after")
    def _arch_supports_quant(self) -> TrtllmTarget:
        fp8_used = (
            self.quant == "fp8" or self.kv_cache_dtype == "fp8" or self.profile.plugins.use_fp8_context_fmha
        )
        if fp8_used and gpu_arch_number(self.gpu_arch) < 89:
            raise ValueError(f"FP8 needs sm89 (Ada) or newer; gpu_arch is {self.gpu_arch}")
        if self.profile.plugins.use_fp8_context_fmha and self.quant != "fp8":
            raise ValueError("plugins.use_fp8_context_fmha needs quant: fp8")
        if self.quant == "bf16" and gpu_arch_number(self.gpu_arch) < 80:
            raise ValueError(f"bfloat16 needs sm80 or newer; gpu_arch is {self.gpu_arch}")
        return self

    @property
    def needs_calibration(self) -> bool:
        return self.quant in ("int8_sq", "fp8") or self.kv_cache_dtype != "auto"

    def check(self, config: dict[str, Any] | None) -> list[str]:
        """Tensor parallelism must split the attention heads; weights plus a full KV cache for the
        profile must fit the stated GPU memory (skipped while the model's config is unknown here)."""
        if not config:
            return []
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads", heads)
        if heads % self.tp_size or kv_heads % self.tp_size:
            return [
                f"tp_size: {self.tp_size} does not divide the model's {heads} attention heads and "
                f"{kv_heads} KV heads"
            ]
        if self.gpu_memory_gib is None:
            return []
        need = self.memory_estimate(config)
        usable = self.gpu_memory_gib * 0.9  # what TensorRT-LLM leaves itself by default
        if need["total_gib"] <= usable:
            return []
        p = self.profile
        return [
            f"profile: needs ~{need['total_gib']:.1f} GiB per GPU (weights {need['weights_gib']:.1f} + "
            f"KV cache {need['kv_cache_gib']:.1f} for {p.max_batch_size} x {p.max_seq_len} tokens) but "
            f"gpu_memory_gib {self.gpu_memory_gib} leaves {usable:.1f}; lower max_batch_size or "
            "max_seq_len, or raise tp_size"
        ]

    def memory_estimate(self, config: dict[str, Any]) -> dict[str, float]:
        """GiB per GPU: weights at the target's precision and a KV cache for the whole profile."""
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads", heads)
        head_dim = config.get("head_dim", hidden // heads)
        per_layer = (
            hidden * heads * head_dim * 2  # q and o projections
            + hidden * kv_heads * head_dim * 2  # k and v
            + hidden * config["intermediate_size"] * 3  # gate, up, down
        )
        embeddings = config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings") else 2)
        weight_bytes = {"fp16": 2, "bf16": 2, "int8_sq": 1, "int8_wo": 1, "fp8": 1}[self.quant]
        weights = (per_layer * layers * weight_bytes + embeddings * 2) / self.tp_size
        kv_bytes = 1 if self.kv_cache_dtype == "fp8" else 2
        p = self.profile
        kv = 2 * layers * kv_heads * head_dim * kv_bytes * p.max_batch_size * p.max_seq_len / self.tp_size
        gib = 2**30
        return {"weights_gib": weights / gib, "kv_cache_gib": kv / gib, "total_gib": (weights + kv) / gib}

    def build_gpu_arch(self) -> str | None:
        return self.gpu_arch

    def unavailable(self, ctx: BuildContext, name: str) -> str | None:
        """Why this host cannot build the engine (None when it can). A TensorRT-LLM of another
        release line is an error, not a host limitation."""
        env = environment(ENV_TRTLLM)
        if not env.exists:
            return (
                f"TensorRT-LLM is not installed on this host (no {env.interpreter}; set "
                "PIPELINE_TRTLLM_PYTHON to the python of the TensorRT-LLM 1.2 container or venv) and "
                "its engines need an NVIDIA GPU; build on a GPU host"
            )
        info = ctx.toolchain(ENV_TRTLLM)
        version = info["toolchain"].get("tensorrt_llm")
        if not version or not version.startswith(TRTLLM_RELEASE_LINE):
            raise EngineError(
                f"{name}: TensorRT-LLM {version or 'not importable'} in {env.interpreter}; "
                f"engines need the {TRTLLM_RELEASE_LINE}x line (later releases removed trtllm-build)"
            )
        gpu = info.get("gpu")
        if gpu is None:
            return "no CUDA GPU visible to the TensorRT-LLM environment"
        if gpu["arch"] != self.gpu_arch:
            return (
                f"this host's GPU is {gpu['name']} ({gpu['arch']}); the target is for {self.gpu_arch} "
                "and an engine only runs on the architecture that built it"
            )
        return None

    def plan(self, layout: Layout, name: str) -> dict[str, Any]:
        argv = trtllm_build_argv(self, checkpoint_dir(layout, name), engine_dir(layout, name))
        return {
            "checkpoint": {
                "tool": "ModelOpt (modelopt.torch.quantization + export_tensorrt_llm_checkpoint)",
                "quant_algo": QUANT_ALGO[self.quant],
                "dtype": export_dtype(self),
                "out_dir": str(checkpoint_dir(layout, name)),
            },
            "command": shlex.join(argv),
            "argv": argv,
            "build_config": build_config(self),
        }

    def build(self, ctx: BuildContext, name: str, out: Path) -> BuildOutput:
        checkpoint, ckpt_info = self.checkpoint(ctx, name)
        engine = engine_dir(ctx.layout, name)
        shutil.rmtree(engine, ignore_errors=True)
        argv = trtllm_build_argv(self, checkpoint, engine)
        ctx.reporter.step(name, "trtllm-build")
        try:
            built = ctx.step(
                ENV_TRTLLM, {"op": "build", "argv": argv, "output_dir": str(engine)}, name,
                timeout_s=ENGINE_TIMEOUT_S,
            )  # fmt: skip
            engine_config = json.loads((engine / "config.json").read_text())
            problems = engine_config_mismatches(self, engine_config)
            if problems:
                why = "; ".join(problems)
                raise BuildError(f"{name}: the engine's build_config differs from the recipe: {why}")
            for f in engine.iterdir():
                shutil.move(str(f), out / f.name)
        finally:
            shutil.rmtree(engine, ignore_errors=True)
        tokenizer = out / TOKENIZER_DIR
        tokenizer.mkdir()
        for f in ctx.source.path.iterdir():
            if f.is_file() and (f.name.startswith(TOKENIZER_FILE_PREFIXES) or f.name in TOKENIZER_FILES):
                shutil.copy(f, tokenizer / f.name)
        gpu = ctx.toolchain(ENV_TRTLLM)["gpu"]
        return BuildOutput(
            quant=f"trtllm-{self.quant}",
            gpu_arch=gpu["arch"],
            profile=build_config(self),
            trtllm={
                "command": argv,
                "engines": built["engines"],
                "engine_version": engine_config.get("version"),
                "build_seconds": round(built["seconds"], 1),
                "gpu": gpu,
                "checkpoint": ckpt_info,
            },
        )

    def checkpoint_request(self, ctx: BuildContext, out: Path) -> dict[str, Any]:
        """The ModelOpt worker's request for this engine's TensorRT-LLM checkpoint."""
        return checkpoint_request(
            ctx, out, export="trtllm", quant=self.quant, dtype=export_dtype(self),
            calibration=self.calibration, tp_size=self.tp_size, kv_cache_dtype=self.kv_cache_dtype,
            smoothquant_alpha=self.smoothquant_alpha,
        )  # fmt: skip

    def checkpoint(self, ctx: BuildContext, name: str) -> tuple[Path, dict[str, Any]]:
        """The ModelOpt checkpoint for this target, reused while its inputs are unchanged."""
        request = self.checkpoint_request(ctx, Path("."))

        def export(tmp: Path) -> None:
            ctx.reporter.step(name, f"ModelOpt {self.quant} checkpoint")
            result = ctx.step(
                ENV_MODELOPT, {**request, "out_dir": str(tmp)}, name, timeout_s=CHECKPOINT_TIMEOUT_S
            )
            problems = check_checkpoint_config(self, result["config"])
            if problems:
                why = "; ".join(problems)
                raise BuildError(f"{name}: ModelOpt wrote a checkpoint the recipe did not ask for: {why}")
            info = {
                "quantization": result["config"].get("quantization"),
                "mapping": result["config"].get("mapping"),
                "calibration": result["calibration"],
                "export_seconds": round(result["export_seconds"], 1),
                "device": result["device"],
                "toolchain": result["toolchain"],
            }
            (tmp / CHECKPOINT_INFO).write_text(json.dumps(info))

        inputs = {
            "request": {k: v for k, v in request.items() if k not in ("model_dir", "out_dir")},
            "source": ctx.source.sha256,
            "calibration": file_sha256(Path(request["text_path"])) if request["text_path"] else None,
            "selection": SELECTION_VERSION,
            "toolchain": ctx.versions(ENV_MODELOPT),
        }
        path = ctx.cached(checkpoint_dir(ctx.layout, name).name, inputs, export)
        return path, json.loads((path / CHECKPOINT_INFO).read_text())

    def validate(self, ctx: BuildContext, name: str, artifact: Path) -> Validation:
        ref, ref_dir = ctx.reference()
        if not self.gather_context_logits:
            reason = "engine built without --gather_context_logits: no perplexity or KLD"
            return Validation.of(
                ENGINE_TRTLLM, {ENGINE_TRTLLM: not_run("skipped", reason)}, reference_record(ref)
            )
        ctx.reporter.step(name, "validating in the TensorRT-LLM runtime")
        got = ctx.step(
            ENV_TRTLLM,
            {
                "op": "validate",
                "engine_dir": str(artifact),
                "tokenizer_dir": str(artifact / TOKENIZER_DIR),
                "reference": ref,
                "reference_dir": str(ref_dir),
                "eos_token_id": ref["eos_token_ids"][0],
                "max_new_tokens": ctx.loaded.recipe.smoke.max_new_tokens,
            },
            name,
            timeout_s=VALIDATE_TIMEOUT_S,
        )
        result = verdict(ctx, ENGINE_TRTLLM, got, ref, self.gates, {"load_s": got["load_s"]})
        return Validation.of(ENGINE_TRTLLM, {ENGINE_TRTLLM: result}, reference_record(ref))

    def serve_argv(self, serve: ServeSpec) -> list[str]:
        argv = ["trtllm-serve", ARTIFACT_DIR, "--backend", "tensorrt"]
        argv += ["--tokenizer", f"{ARTIFACT_DIR}/{TOKENIZER_DIR}"]
        argv += ["--host", serve.host, "--port", str(serve.port)]
        argv += ["--kv_cache_free_gpu_memory_fraction", str(serve.trtllm.kv_cache_free_gpu_memory_fraction)]
        return argv
