"""The requests the core sends to the step workers and the replies it reads back: one model per
worker op each way, shared by both sides.

The core checks a request before it starts the step (`pipeline.context.BuildContext.step`, the
source's materialising step) and the worker checks it again on arrival (`protocol.worker_main`), so
a misspelt or missing key fails at once, naming it, instead of as a KeyError deep in a tool's
environment or as a knob silently ignored. Both sides keep sending and reading the same JSON dict:
the check changes no byte of what a step receives. Replies are checked the same way, by the worker
before it writes one and by the core when it reads one (`pipeline.environments.run_step`): a reply
model lists the fields the core reads, typed; what else a worker reports (a tool's own details)
passes through to the manifest untouched.

Only pydantic is imported here: every tool environment has it (the GPU kit carries it in `core`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Request(BaseModel):
    """A worker request: `op` plus the op's own fields, no others."""

    model_config = ConfigDict(extra="forbid")
    op: str


class Toolchain(Request):
    pass


class Calibration(Request):
    """The calibration fields of a quantizer's request (`BuildContext.calibration_request`); no
    text (an FP16 engine) calibrates nothing."""

    text_path: str | None
    samples: int
    seq_len: int
    seed: int


class Quantize(Calibration):
    """llm-compressor's and GPTQModel's AWQ/GPTQ (`Int4Target.quantize_request`)."""

    method: str
    model_dir: str
    out_dir: str
    trust_remote_code: bool
    bits: int
    group_size: int
    symmetric: bool
    ignore: list[str]
    dtype: str
    n_grid: int | None = None  # AWQ
    act_order: str | bool | None = None  # GPTQ
    dampening_frac: float | None = None  # GPTQ


class ModeloptCheckpoint(Calibration):
    format: str
    model_dir: str
    out_dir: str
    trust_remote_code: bool
    quant: str
    dtype: str
    tp_size: int
    kv_cache_dtype: str
    smoothquant_alpha: float
    group_size: int | None


class Scored(Request):
    """What every engine's validation scores against: the reference and the smoke length."""

    reference: dict[str, Any]
    reference_dir: str
    max_new_tokens: int


class VllmValidate(Scored):
    model_dir: str
    dtype: str
    gpu_memory_utilization: float
    tensor_parallel_size: int = 1
    linear_backend: str | None = None  # vLLM's --linear-backend, as the deploy command has it


class SglangValidate(Scored):
    model_dir: str
    quantization: str | None
    dtype: str
    mem_fraction_static: float
    attention_backend: str | None
    tp_size: int = 1


class TrtllmValidate(Scored):
    engine_dir: str
    tokenizer_dir: str
    eos_token_id: int


class TrtllmBuild(Request):
    argv: list[str]
    output_dir: str


class ServeCheck(Request):
    """The deploy command served once (`pipeline.engines.serving.serve_check`)."""

    model_dir: str
    argv: list[str]
    port: int
    prompt_ids: list[int]
    max_tokens: int
    expected_text: str
    expected_ids: list[int]
    expected_top: list[Any]
    server_log: str | None = None
    ready_timeout_s: float


class Benchmark(Request):
    """The serving benchmark (`pipeline.serving`): the server's argv and GuideLLM's workloads, run
    in order on the one server."""

    argv: list[str]
    python: str
    server_env: dict[str, str] = {}
    model_dir: str
    tokenizer: str
    workloads: list[dict[str, Any]] = Field(min_length=1)
    server_log: str
    ready_timeout_s: float
    port: int


class Reference(Request):
    model_dir: str
    trust_remote_code: bool
    eval_text_path: str
    eval_tokens: int
    ctx: int
    prompts: list[str]
    max_new_tokens: int
    chat: bool
    out_dir: str


class Imatrix(Request):
    """An importance matrix: llama-imatrix on the F16 GGUF (`base_path`), or the transformers
    hooks on the source (`model_dir` and the GGUF's tensor names)."""

    text_path: str
    samples: int
    seq_len: int
    seed: int
    out_path: str
    base_path: str | None = None
    threads: int | None = None
    model_dir: str | None = None
    trust_remote_code: bool | None = None
    gguf_arch: str | None = None
    gguf_tensors: dict[str, int] | None = None


class MaterialiseGguf(Request):
    gguf_path: str
    out_dir: str


class Placement(Request):
    model_dir: str


class Convert(Request):
    model_dir: str
    out_path: str
    outtype: str


class GgufQuantize(Request):
    in_path: str
    out_path: str
    quant: str
    threads: int | None = None
    imatrix_path: str | None = None


class Inspect(Request):
    path: str


class LlamacppValidate(Scored):
    gguf_path: str
    eval_text_path: str
    threads: int | None = None
    gpus: int = 1  # split over that many GPUs (the target's tp_size), in split_mode
    split_mode: Literal["layer", "row", "tensor"] = "layer"


class KldBase(Request):
    gguf_path: str
    text_path: str
    ctx: int
    chunks: int
    threads: int | None = None
    out_path: str


class Kld(Request):
    gguf_path: str
    kld_base_path: str
    ctx: int
    threads: int | None = None
    gpus: int = 1
    split_mode: Literal["layer", "row", "tensor"] = "layer"


class Reply(BaseModel):
    """A worker reply: the fields the core reads; the rest passes through."""

    model_config = ConfigDict(extra="allow")


class ToolchainReply(Reply):
    toolchain: dict[str, str | None]
    # a deploy command's programs as this host runs them: llama-server -> the build's copy
    programs: dict[str, str] = {}


class Scores(Reply):
    """What every engine's validation reports (pipeline.workers.scoring): `ppl` always, the rest
    where that engine measures it."""

    ppl: float
    kld_mean: float | None = None
    kld_topk_mean: float | None = None
    top1_agreement: float | None = None
    predicted_tokens: int | None = None
    token_agreement: float | None = None
    tokens_per_s: float | None = None
    generations: list[dict[str, Any]] = []


class VllmScores(Scores):
    startup_s: float
    quantization: str | None
    device: str
    engine_env: dict[str, str]
    settings: dict[str, Any]
    first_generation_top_logprobs: list[dict[str, float]]
    generations: list[dict[str, Any]]


class SglangScores(Scores):
    startup_s: float
    device: str
    settings: dict[str, Any]
    generations: list[dict[str, Any]]


class LlamacppScores(Scores):
    load_s: float
    tokenizer_prefix_match: Any
    placement: dict[str, Any]
    eos_token_id: int | None
    first_generation_top_logprobs: list[dict[str, float]]


class TrtllmScores(Scores):
    load_s: float


class Served(Reply):
    """The serve check's answer (pipeline.workers.serving)."""

    ok: bool
    compared: str
    divergence: dict[str, Any] | None
    text: str
    token_ids: list[int] | None


class Quantized(Reply):
    """llm-compressor's and GPTQModel's AWQ/GPTQ."""

    quantization_config: dict[str, Any]
    # GPTQ's column order as the checkpoint holds it: llm-compressor's `actorder` (`weight`),
    # GPTQModel's `group-aware` or `desc_act` (group indices in activation order); None: plain
    activation_order: str | None = None
    toolchain: dict[str, str | None]
    seconds: float
    device: str
    chunks: int
    tokens: int


class Checkpointed(Reply):
    """ModelOpt's checkpoint (HF or TensorRT-LLM)."""

    config: dict[str, Any] | None
    calibration: Any
    export_seconds: float
    device: str
    toolchain: dict[str, str | None]


class WorkloadMeasured(BaseModel):
    """One workload's GuideLLM run: its seconds and each level's numbers, or why it has none (a
    later workload's run failed, or one before it did; the first one's failure fails the step)."""

    seconds: float | None = None
    levels: list[dict[str, Any]] = []
    error: str | None = None


class Benchmarked(Reply):
    tool: str
    seconds: float
    runs: list[WorkloadMeasured]  # one per request workload, in order


class ReferenceReply(Reply):
    """The transformers reference: what every verdict is relative to."""

    ppl: float
    ctx: int
    eval_ids: list[int]
    generations: list[dict[str, Any]]
    eos_token_ids: list[int]
    scored_from: int
    toolchain: dict[str, str | None]


class Inspected(Reply):
    architecture: str | None
    tensor_types: dict[str, int]
    rows: dict[str, int]
    tensor_bytes: dict[str, int]  # each tensor as stored (pipeline.decode_bound)


class ImatrixReply(Reply):
    tensors: int
    chunks: int | None  # llama-imatrix's own count, when its GGUF records one
    tokens: int


class KldReply(Reply):
    """llama-perplexity --kl-divergence's numbers."""

    chunks: int | None
    ppl: float
    ppl_base: float


WORKERS = "pipeline.workers."
# worker module -> op -> its request model (the ops each worker's worker_main dispatches)
REQUESTS: dict[str, dict[str, type[Request]]] = {
    WORKERS + "llamacpp": {
        "toolchain": Toolchain, "convert": Convert, "quantize": GgufQuantize, "inspect": Inspect,
        "validate": LlamacppValidate, "imatrix": Imatrix, "kld_base": KldBase, "kld": Kld,
        "serve_check": ServeCheck,
    },
    WORKERS + "reference": {
        "toolchain": Toolchain, "reference": Reference, "imatrix": Imatrix,
        "materialise_gguf": MaterialiseGguf, "placement": Placement,
    },
    WORKERS + "llmcompressor": {"toolchain": Toolchain, "quantize": Quantize},
    WORKERS + "gptqmodel": {"toolchain": Toolchain, "quantize": Quantize},
    WORKERS + "modelopt": {"toolchain": Toolchain, "checkpoint": ModeloptCheckpoint},
    WORKERS + "vllm": {"toolchain": Toolchain, "validate": VllmValidate, "serve_check": ServeCheck},
    WORKERS + "sglang": {"toolchain": Toolchain, "validate": SglangValidate, "serve_check": ServeCheck},
    WORKERS + "trtllm": {"toolchain": Toolchain, "build": TrtllmBuild, "validate": TrtllmValidate},
    WORKERS + "loadgen": {"toolchain": Toolchain, "benchmark": Benchmark},
}  # fmt: skip


# worker module -> op -> the model of its reply (an op not named here is not checked)
REPLIES: dict[str, dict[str, type[Reply]]] = {
    WORKERS + "llamacpp": {
        "toolchain": ToolchainReply, "inspect": Inspected, "validate": LlamacppScores,
        "imatrix": ImatrixReply, "kld": KldReply, "serve_check": Served,
    },
    WORKERS + "reference": {
        "toolchain": ToolchainReply, "reference": ReferenceReply, "imatrix": ImatrixReply,
    },
    WORKERS + "llmcompressor": {"toolchain": ToolchainReply, "quantize": Quantized},
    WORKERS + "gptqmodel": {"toolchain": ToolchainReply, "quantize": Quantized},
    WORKERS + "modelopt": {"toolchain": ToolchainReply, "checkpoint": Checkpointed},
    WORKERS + "vllm": {"toolchain": ToolchainReply, "validate": VllmScores, "serve_check": Served},
    WORKERS + "sglang": {"toolchain": ToolchainReply, "validate": SglangScores, "serve_check": Served},
    WORKERS + "trtllm": {"toolchain": ToolchainReply, "validate": TrtllmScores},
    WORKERS + "loadgen": {"toolchain": ToolchainReply, "benchmark": Benchmarked},
}  # fmt: skip


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(message)'}: "
        + ("not a field of this op" if e["type"] == "extra_forbidden" else e["msg"].lower())
        for e in exc.errors()
    )


def check_reply(worker: str, op: str, reply: dict[str, Any]) -> None:
    """Raise ValueError in one line naming every missing or mistyped field of `worker`'s reply to
    `op` (an error reply, or an op without a model here, is not checked)."""
    model = REPLIES.get(worker, {}).get(op)
    if model is None or "error" in reply:
        return
    try:
        model.model_validate(reply)
    except ValidationError as exc:
        raise ValueError(f"{worker} {op} reply: {_problems(exc)}") from None


def check_request(worker: str, request: dict[str, Any]) -> None:
    """Raise ValueError in one line naming every bad field of `request` for `worker`'s op (a
    worker or op without a model here is not checked)."""
    model = REQUESTS.get(worker, {}).get(str(request.get("op")))
    if model is None:
        return
    try:
        model.model_validate(request)
    except ValidationError as exc:
        raise ValueError(f"{worker} {request.get('op')} request: {_problems(exc)}") from None
