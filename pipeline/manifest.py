"""The artifact manifest as typed models: what builders, validations and the registry hand each
other. Validated on write and on read; the field names are an interface (shared/DESIGN.md).

Schema `pipeline.artifact/v2` (v1 had one flat `toolchain` dict and one verdict): `toolchain` holds
each environment's versions separately, `validation.engines` one verdict per serving engine, and
`kld_mean` (full vocabulary) and `kld_topk_mean` (top-k lower bound) are different metrics.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.constants import CONTENDED_SHARE, MANIFEST_NAME, MANIFEST_SCHEMA
from pipeline.errors import DiskFullError, RegistryError

Status = Literal["passed", "failed", "skipped", "unavailable"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class FileEntry(_Model):
    path: str
    sha256: str
    bytes: int


class Metrics(BaseModel):
    """The numbers every engine reports the same way (pipeline.workers.scoring says what each
    means), plus engine-specific ones (load_s, startup_s, ppl_engine_ref, ...)."""

    model_config = ConfigDict(extra="allow")

    ppl: float
    ppl_ref: float
    ppl_delta_pct: float
    kld_mean: float | None = None  # full-vocabulary KL(reference || engine)
    kld_topk_mean: float | None = None  # its lower bound from the engine's top-k logprobs
    kld_top_k: int | None = None
    top1_agreement: float
    token_agreement: float
    tokens_per_s: float | None  # smoke prompts one at a time, prefill included
    prompt_tokens_per_s: float | None
    eval_tokens: int
    scored_tokens: int | None = None  # the predictions the numbers are over (from ctx/2 of each window)


class EngineVerdict(_Model):
    """One serving engine's verdict on an artifact."""

    status: Status
    reason: str | None = None
    engine_version: str | None = None
    metrics: Metrics | None = None
    gates: dict[str, Any] | None = None
    generations: list[dict[str, Any]] = []
    details: dict[str, Any] = {}  # serve check, engine settings, the engine's own reference


class Validation(_Model):
    """`status`, `reason` and `metrics` are the primary engine's; `engines` has every verdict."""

    status: Status
    reason: str | None = None
    engine: str
    metrics: Metrics | None = None
    engines: dict[str, EngineVerdict]
    reference: dict[str, Any] | None = None

    @classmethod
    def of(
        cls, primary: str, verdicts: dict[str, EngineVerdict], reference: dict[str, Any] | None
    ) -> Validation:
        first = verdicts[primary]
        return cls(
            status=first.status,
            reason=first.reason,
            engine=primary,
            metrics=first.metrics,
            engines=verdicts,
            reference=reference,
        )

    def failed_engines(self) -> list[str]:
        return [name for name, v in self.engines.items() if v.status == "failed"]


class StepRecord(_Model):
    """One step a build ran in a tool environment: wall time, peak RSS of its process group, peak
    GPU memory in use (device-wide; None without an NVIDIA GPU), and the share of the host's CPUs
    other processes used meanwhile (above CONTENDED_SHARE its timings are contended; None in
    manifests from before 2026-12-03). pipeline.environments.StepUsage."""

    env: str
    op: str
    log: str
    seconds: float
    peak_rss_mib: float
    peak_gpu_mib: float | None = None
    others_cpu_share: float | None = None
    peak_gpu_mib_each: list[float] | None = None  # per GPU where the host has several (null: one or none)

    @property
    def contended(self) -> bool:
        return (self.others_cpu_share or 0.0) > CONTENDED_SHARE


class BuildInfo(_Model):
    seconds: float
    gpu_arch: str | None = None
    profile: dict[str, Any] | None = None
    inputs_sha256: str
    finished_at: str
    host: str | None = None  # the machine that built it (absent in manifests from before 2026-12)
    node: str | None = None  # the Ray node id, when a cluster build placed it (`--cluster`)
    spec: dict[str, Any]
    steps: list[StepRecord] = []  # the steps this build ran (cached ones it reused are absent)
    # what decided the files alone (pipeline.project.bytes_sha256; absent before 2026-12-06)
    bytes_sha256: str | None = None
    # the earlier build whose files this one kept, its inputs having moved only in what decides the
    # numbers (serving knobs, the serving benchmark, the reference): its inputs_sha256, finished_at,
    # host and seconds; its steps are in that version's manifest
    bytes_from: dict[str, Any] | None = None


class ServingLevel(_Model):
    """The serving benchmark at one concurrency: latency percentiles in ms, throughput, peaks."""

    concurrency: int
    completed: int
    errored: int
    planned: int | None = None  # the requests the level was to run: whole waves of its concurrency
    incomplete: int | None = None  # cut off by max_seconds_per_level: the level is not comparable
    ttft_ms_p50: float | None = None
    ttft_ms_p99: float | None = None
    itl_ms_p50: float | None = None
    itl_ms_p99: float | None = None
    output_tokens_per_s: float | None = None  # finished requests' tokens over the level's window
    # every request's tokens streamed inside the window, those a cap cut included (None: recorded
    # before 2026-12-07); the same as output_tokens_per_s where nothing was cut or errored
    streamed_tokens_per_s: float | None = None
    requests_per_s: float | None = None
    output_tokens_mean: float | None = None  # per successful request (the workload fixes it)
    peak_rss_mib: float | None = None  # the server's process group
    peak_gpu_mib: float | None = None  # device-wide, None without an NVIDIA GPU
    others_cpu_share: float | None = None  # other processes' share of the host's CPUs meanwhile

    @property
    def contended(self) -> bool:
        return (self.others_cpu_share or 0.0) > CONTENDED_SHARE

    @property
    def cut(self) -> bool:
        """Whether the level's time cap ended it before its requests had finished."""
        return bool(self.incomplete)


class DecodeBound(_Model):
    """Batch-1 decoding's memory-bandwidth bound for an artifact on the host that served it
    (pipeline.decode_bound): bytes each output token reads and what that allows."""

    weights_bytes: int  # weights as stored, minus the input embedding table unless it is the head
    kv_bytes: int  # the 16-bit KV cache at context_tokens
    context_tokens: int  # the workload's prompt + output tokens
    bytes_per_token: int
    bandwidth_gbs: float | None = None  # None: no figure for this device
    bandwidth_from: str
    bound_tokens_per_s: float | None = None
    share_c1: float | None = None  # concurrency 1's output tokens/s over the bound
    flag: str | None = None  # set below pipeline.decode_bound.LOW_SHARE
    # the share of the decoder's layers its deploy command put on the GPU, where not all (llama.cpp's
    # -ngl N): no one bandwidth bounds it, and a GPU holds that share of its weights and KV cache
    gpu_layer_share: float | None = None


class WorkloadRun(_Model):
    """The serving benchmark's numbers at one more workload (the recipe's more_workloads), measured
    on the same server after the first; `failed` with the reason where its run (or an earlier
    further workload's) failed, the first workload's numbers kept."""

    workload: dict[str, Any]
    status: Status = "passed"
    reason: str | None = None
    seconds: float | None = None
    levels: dict[str, ServingLevel] = {}  # str(concurrency) -> numbers
    decode_bound: DecodeBound | None = None


class ServingResult(_Model):
    """One engine's serving benchmark of an artifact, through its serve command (pipeline.serving).
    It never changes the artifact's bytes or its validation verdict. `workload`, `levels` and
    `decode_bound` are the first workload's; `more_workloads` the recipe's further shapes."""

    status: Status
    reason: str | None = None
    tool: str | None = None  # the load generator and its version
    workload: dict[str, Any] = {}
    seconds: float | None = None
    levels: dict[str, ServingLevel] = {}  # str(concurrency) -> numbers
    device: str | None = None  # where it ran: the GPU's name (nvidia-smi) or "cpu"; None: not recorded
    gpu_arch: str | None = None
    memory_setting: dict[str, Any] = {}  # the serve command's reservation knob and its value
    kv_cache: dict[str, Any] | None = None  # what the server logged when it allocated its KV cache
    # its server's lines naming the kernels and mode it decoded with (pipeline.constants kernel_log, mode_log)
    engine_mode: list[str] = []
    decode_bound: DecodeBound | None = None
    more_workloads: list[WorkloadRun] = []


class ServeInfo(_Model):
    command: str
    tp_size: int = 1  # GPUs the command shards the model over (a deploy host needs as many)


class Manifest(_Model):
    schema_: Literal["pipeline.artifact/v2"] = Field(MANIFEST_SCHEMA, alias="schema")
    recipe: str
    recipe_sha256: str
    recipe_path: str
    target: str
    kind: str
    engine: str
    format: str
    quant: str
    source: dict[str, Any]
    files: list[FileEntry]
    toolchain: dict[str, dict[str, str | None]]  # environment -> package -> version, lock, worker_sha256
    build: BuildInfo
    validation: Validation
    serve: ServeInfo
    serving: dict[str, ServingResult] = {}  # engine -> its serving benchmark
    # what one kind records about how it was made
    gguf: dict[str, Any] | None = None
    quantization: dict[str, Any] | None = None
    trtllm: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json", by_alias=True), indent=2) + "\n"

    @property
    def size_bytes(self) -> int:
        return sum(f.bytes for f in self.files)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write `manifest.json` atomically (validated: a Manifest cannot hold a wrong shape)."""
    tmp = directory / f".{MANIFEST_NAME}.tmp"
    try:
        tmp.write_text(Manifest.model_validate(manifest.model_dump(by_alias=True)).to_json())
        tmp.replace(directory / MANIFEST_NAME)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise DiskFullError(f"no space left on device writing {directory / MANIFEST_NAME}") from None
        raise


def parse_manifest(text: str, where: Path | str) -> Manifest:
    """A manifest from its JSON text, or a one-line RegistryError saying what does not match."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise RegistryError(f"{where} is corrupted: {exc}") from None
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema != MANIFEST_SCHEMA:
        raise RegistryError(
            f"{where} has schema {schema!r}, this pipeline reads {MANIFEST_SCHEMA!r}. To resolve, "
            "rebuild the target (`pipeline build RECIPE --targets T --force`)"
        )
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise RegistryError(
            f"{where} does not match {MANIFEST_SCHEMA}: {loc}: {first['msg']} "
            f"({exc.error_count()} problem(s))"
        ) from None


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RegistryError(f"no artifact at {directory} ({MANIFEST_NAME} missing)") from None
    return parse_manifest(text, path)
