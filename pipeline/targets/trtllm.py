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
from typing import Any

from pipeline.artifacts import Layout
from pipeline.constants import ENV_MODELOPT, ENV_TRTLLM, REFERENCE_KEY_FILE
from pipeline.engines.calibration import SELECTION_VERSION
from pipeline.errors import BuildError, EngineError
from pipeline.hashing import file_sha256, json_sha256
from pipeline.recipe import LoadedRecipe, ServeSpec, TargetSpec, TrtllmTarget
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

MODELOPT = "pipeline.engines.modelopt"
TRTLLM = "pipeline.engines.trtllm"
TRTLLM_RELEASE_LINE = "1.2."  # the engine backend and trtllm-build were removed after 1.2
CHECKPOINT_TIMEOUT_S = 6 * 3600
ENGINE_TIMEOUT_S = 6 * 3600
VALIDATE_TIMEOUT_S = 3600
TOKENIZER_DIR = "tokenizer"  # beside the engine files: what the runtime and trtllm-serve read
TOKENIZER_FILE_PREFIXES = ("tokenizer", "special_tokens")
TOKENIZER_FILES = ("config.json", "generation_config.json", "chat_template.jinja")
# recipe quant -> the checkpoint's `quantization.quant_algo` (TensorRT-LLM QuantAlgo names)
QUANT_ALGO = {"fp16": None, "bf16": None, "int8_sq": "W8A8_SQ_PER_CHANNEL", "int8_wo": "W8A16", "fp8": "FP8"}


def export_dtype(spec: TrtllmTarget) -> str:
    return {"fp16": "float16", "bf16": "bfloat16"}.get(spec.quant, spec.dtype)


def checkpoint_dir(layout: Layout, name: str) -> Path:
    return layout.cache_dir / f"trtllm-checkpoint-{name}"


def engine_dir(layout: Layout, name: str) -> Path:
    return layout.cache_dir / f"trtllm-engine-{name}"


def checkpoint_request(
    loaded: LoadedRecipe, spec: TrtllmTarget, model_dir: Path, out: Path
) -> dict[str, Any]:
    """The ModelOpt worker's request for one engine target's checkpoint."""
    return {
        "op": "checkpoint",
        "format": "trtllm",
        "model_dir": str(model_dir),
        "out_dir": str(out),
        "trust_remote_code": loaded.recipe.source.trust_remote_code,
        "quant": spec.quant,
        "dtype": export_dtype(spec),
        "tp_size": spec.tp_size,
        "kv_cache_dtype": spec.kv_cache_dtype,
        "smoothquant_alpha": spec.smoothquant_alpha,
        **calibration_request(loaded, spec.calibration),
    }


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
class TrtllmBuilder(TargetBuilder):
    kind = "trtllm"
    engine = "tensorrt-llm"
    format = "tensorrt-engine"
    environments = (ENV_MODELOPT, ENV_TRTLLM)
    gpu_host = True

    def unavailable(self, ctx: BuildContext, name: str, spec: TargetSpec) -> str | None:
        """Why this host cannot build the engine (None when it can). A TensorRT-LLM of another
        release line is an error, not a host limitation."""
        assert isinstance(spec, TrtllmTarget)
        if not environment_exists(ENV_TRTLLM):
            return (
                f"TensorRT-LLM is not installed on this host (no {interpreter(ENV_TRTLLM)}; set "
                "PIPELINE_TRTLLM_PYTHON to the python of the TensorRT-LLM 1.2 container or venv) and "
                "its engines need an NVIDIA GPU; build on a GPU host"
            )
        info = ctx.toolchain(ENV_TRTLLM)
        version = info["toolchain"].get("tensorrt_llm")
        if not version or not version.startswith(TRTLLM_RELEASE_LINE):
            raise EngineError(
                f"{name}: TensorRT-LLM {version or 'not importable'} in {interpreter(ENV_TRTLLM)}; "
                f"engines need the {TRTLLM_RELEASE_LINE}x line (later releases removed trtllm-build)"
            )
        gpu = info.get("gpu")
        if gpu is None:
            return "no CUDA GPU visible to the TensorRT-LLM environment"
        if gpu["arch"] != spec.gpu_arch:
            return (
                f"this host's GPU is {gpu['name']} ({gpu['arch']}); the target is for {spec.gpu_arch} "
                "and an engine only runs on the architecture that built it"
            )
        return None

    def plan(self, layout: Layout, name: str, spec: TargetSpec) -> dict[str, Any]:
        assert isinstance(spec, TrtllmTarget)
        argv = trtllm_build_argv(spec, checkpoint_dir(layout, name), engine_dir(layout, name))
        return {
            "checkpoint": {
                "tool": "ModelOpt (modelopt.torch.quantization + export_tensorrt_llm_checkpoint)",
                "quant_algo": QUANT_ALGO[spec.quant],
                "dtype": export_dtype(spec),
                "out_dir": str(checkpoint_dir(layout, name)),
            },
            "command": shlex.join(argv),
            "argv": argv,
            "build_config": build_config(spec),
        }

    def build(self, ctx: BuildContext, name: str, spec: TargetSpec, out: Path) -> dict[str, Any]:
        assert isinstance(spec, TrtllmTarget)
        checkpoint, ckpt_info = self._checkpoint(ctx, name, spec)
        engine = engine_dir(ctx.layout, name)
        shutil.rmtree(engine, ignore_errors=True)
        argv = trtllm_build_argv(spec, checkpoint, engine)
        ctx.reporter.step(name, "trtllm-build")
        with removed_on_error(engine):
            built = ctx.worker(
                ENV_TRTLLM, TRTLLM, {"op": "build", "argv": argv, "output_dir": str(engine)}, name,
                timeout_s=ENGINE_TIMEOUT_S,
            )  # fmt: skip
        engine_config = json.loads((engine / "config.json").read_text())
        problems = engine_config_mismatches(spec, engine_config)
        if problems:
            why = "; ".join(problems)
            raise BuildError(f"{name}: the engine's build_config differs from the recipe: {why}")
        for f in engine.iterdir():
            shutil.move(str(f), out / f.name)
        shutil.rmtree(engine, ignore_errors=True)
        tokenizer = out / TOKENIZER_DIR
        tokenizer.mkdir()
        for f in ctx.source.path.iterdir():
            if f.is_file() and (f.name.startswith(TOKENIZER_FILE_PREFIXES) or f.name in TOKENIZER_FILES):
                shutil.copy(f, tokenizer / f.name)
        gpu = ctx.toolchain(ENV_TRTLLM)["gpu"]
        return {
            "quant": f"trtllm-{spec.quant}",
            "gpu_arch": gpu["arch"],
            "profile": build_config(spec),
            "trtllm": {
                "command": argv,
                "engines": built["engines"],
                "engine_version": engine_config.get("version"),
                "build_seconds": round(built["seconds"], 1),
                "gpu": gpu,
                "checkpoint": ckpt_info,
            },
        }

    def _checkpoint(self, ctx: BuildContext, name: str, spec: TrtllmTarget) -> tuple[Path, dict[str, Any]]:
        """The ModelOpt checkpoint for this target, reused while its inputs are unchanged."""
        path = checkpoint_dir(ctx.layout, name)
        request = checkpoint_request(ctx.loaded, spec, ctx.source.path, path)
        key = json_sha256(
            {
                "request": {k: v for k, v in request.items() if k not in ("model_dir", "out_dir")},
                "source": ctx.source.sha256,
                "calibration": file_sha256(Path(request["text_path"])) if request["text_path"] else None,
                "selection": SELECTION_VERSION,
                "toolchain": ctx.toolchain(ENV_MODELOPT)["toolchain"],
            }
        )
        info_file = path / "pipeline-checkpoint.json"
        if info_file.is_file() and json.loads(info_file.read_text()).get("key") == key:
            return path, json.loads(info_file.read_text())["info"]
        shutil.rmtree(path, ignore_errors=True)
        ctx.reporter.step(name, f"ModelOpt {spec.quant} checkpoint")
        with removed_on_error(path):
            result = ctx.worker(ENV_MODELOPT, MODELOPT, request, name, timeout_s=CHECKPOINT_TIMEOUT_S)
            problems = check_checkpoint_config(spec, result["config"])
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
            info_file.write_text(json.dumps({"key": key, "info": info}))
        return path, info

    def validate(self, ctx: BuildContext, name: str, spec: TargetSpec, artifact: Path) -> dict[str, Any]:
        assert isinstance(spec, TrtllmTarget)
        ref, ref_dir = ctx.reference()
        if not spec.gather_context_logits:
            reason = "engine built without --gather_context_logits: no perplexity or KLD"
            return {"status": "skipped", "reason": reason, "engine": "tensorrt-llm", "metrics": {}}
        ctx.reporter.step(name, "validating in the TensorRT-LLM runtime")
        got = ctx.worker(
            ENV_TRTLLM,
            TRTLLM,
            {
                "op": "validate",
                "engine_dir": str(artifact),
                "tokenizer_dir": str(artifact / TOKENIZER_DIR),
                "reference": ref,
                "reference_dir": str(ref_dir),
                "reference_key": (ref_dir / REFERENCE_KEY_FILE).read_text(),
                "eos_token_id": ref["eos_token_ids"][0],
                "max_new_tokens": ctx.loaded.recipe.smoke.max_new_tokens,
            },
            name,
            timeout_s=VALIDATE_TIMEOUT_S,
        )
        metrics = {**scored_metrics(got, ref), "load_s": got["load_s"]}
        status, reason = gate(metrics, spec.gates)
        return {
            "status": status,
            "reason": reason,
            "engine": "tensorrt-llm",
            "metrics": metrics,
            "gates": spec.gates.model_dump(),
            "generations": got["generations"],
            "reference": {"engine": "transformers", "toolchain": ref["toolchain"], "dtype": "float32"},
        }

    def serve_command(self, spec: TargetSpec, serve: ServeSpec) -> str:
        assert isinstance(spec, TrtllmTarget)
        return (
            "trtllm-serve ${ARTIFACT_DIR} --backend tensorrt --tokenizer ${ARTIFACT_DIR}/"
            f"{TOKENIZER_DIR} --host {serve.host} --port {serve.port} "
            f"--kv_cache_free_gpu_memory_fraction {serve.trtllm.kv_cache_free_gpu_memory_fraction}"
        )
