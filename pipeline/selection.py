"""`pipeline registry select`: the validated artifacts that fit a deployment scenario, ranked, each
with the measured numbers that put it there, and every other candidate with why it was excluded.

A candidate is one (current version of a target, serving engine) whose engine verdict passed.
Numbers come from its manifest: ΔPPL from the verdict, memory and latency from the serving
benchmark (`serving.<engine>.levels.<concurrency>`) where one ran, else memory from the peak RSS of
the engine's validation step (a CPU host) or the weights' size (named as such).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from pipeline.constants import CONTENDED_SHARE, ENGINES, STATUS_PASSED
from pipeline.errors import RegistryError
from pipeline.manifest import EngineVerdict, Manifest, StepRecord
from pipeline.registry import Registry, VersionEntry
from pipeline.spec import workload_shape

Objective = Literal["accuracy", "throughput", "latency", "size"]
OBJECTIVES: tuple[Objective, ...] = ("accuracy", "throughput", "latency", "size")
MIB = 1024**2


@dataclass(frozen=True)
class Scenario:
    """What a deploy job asks for: where it runs, what it may cost, what it optimises."""

    model: str | None = None
    cpu: bool = False  # a CPU host: only engines whose verdict was obtained on a CPU
    gpu_arch: str | None = None  # a GPU host: artifacts built for another architecture excluded
    gpus: int | None = None  # a GPU host's GPU count: artifacts sharded over more excluded
    memory_gib: float | None = None
    max_ppl_delta: float | None = None
    max_ttft_ms: float | None = None  # p99, at `concurrency`
    max_itl_ms: float | None = None  # p99, at `concurrency`
    concurrency: int = 1
    workload: str | None = None  # "2048/256": the serving numbers' prompt/output tokens (None: the first)
    objective: Objective = "accuracy"


@dataclass
class Candidate:
    recipe: str
    target: str
    version: int
    engine: str
    quant: str
    gpu_arch: str | None
    device: str
    size_bytes: int
    ppl_delta_pct: float | None
    kld_mean: float | None  # full-vocabulary KL to the reference (llama.cpp, TensorRT-LLM verdicts)
    memory_mib: float | None
    memory_from: str
    serving: dict[str, Any] | None  # this engine's numbers at the scenario's concurrency
    serve_command: str
    tp_size: int
    reasons: list[str] = field(default_factory=list)
    excluded: str | None = None
    steps: list[StepRecord] = field(default_factory=list)  # its build's steps (for memory); not shown

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "steps"}


def candidates(registry: Registry, model: str | None) -> list[Candidate]:
    """Every (current version, engine) with its numbers; those whose engine verdict did not pass
    come already excluded, with the verdict's reason."""
    found = []
    for entry in registry.entries(include_failed=True):
        if model is not None and entry.recipe != model:
            continue
        manifest = registry.manifest(entry)
        for engine, verdict in manifest.validation.engines.items():
            candidate = _candidate(entry, manifest, engine, verdict)
            if verdict.status != STATUS_PASSED:
                why = f": {verdict.reason}" if verdict.reason else ""
                candidate.excluded = f"its {engine} verdict is {verdict.status}{why}"
            found.append(candidate)
    return found


def _candidate(entry: VersionEntry, manifest: Manifest, engine: str, verdict: EngineVerdict) -> Candidate:
    device = str(verdict.details.get("device") or ("cpu" if manifest.build.gpu_arch is None else "gpu"))
    serving = manifest.serving.get(engine)
    return Candidate(
        recipe=entry.recipe,
        target=entry.target,
        version=entry.version,
        engine=engine,
        quant=entry.quant,
        gpu_arch=entry.gpu_arch,
        device=device,
        size_bytes=manifest.size_bytes,
        ppl_delta_pct=verdict.metrics.ppl_delta_pct if verdict.metrics else None,
        kld_mean=verdict.metrics.kld_mean if verdict.metrics else None,
        memory_mib=None,
        memory_from="",
        serving=serving.model_dump(mode="json") if serving else None,
        # the primary engine's deploy command is the manifest's; another's, its verdict's
        serve_command=(
            manifest.serve.command
            if engine == manifest.engine
            else str(verdict.details.get("command") or manifest.serve.command)
        ),
        tp_size=manifest.serve.tp_size,
        steps=manifest.build.steps,
    )


def _level(c: Candidate, s: Scenario) -> dict[str, Any] | None:
    """The serving numbers at the scenario's concurrency, where they were measured on the kind of
    host the job runs on (a GPU of its architecture, or a CPU)."""
    if not c.serving or c.serving.get("status") != STATUS_PASSED or _measured_elsewhere(c, s):
        return None
    return (c.serving.get("levels") or {}).get(str(s.concurrency))


def _serving_device(c: Candidate) -> str:
    """Where its serving benchmark ran (older records lack it: where its verdict was obtained)."""
    return str((c.serving or {}).get("device") or c.device)


def _measured_elsewhere(c: Candidate, s: Scenario) -> str | None:
    """Why its serving numbers say nothing of the scenario's host (None: they do)."""
    device, arch = _serving_device(c), (c.serving or {}).get("gpu_arch")
    if s.cpu and not device.startswith("cpu"):
        return f"its serving numbers were measured on {device}, not on a CPU"
    if s.gpu_arch and (device.startswith("cpu") or arch not in (None, s.gpu_arch)):
        measured = f"{device} ({arch})" if arch else device
        return f"its serving numbers were measured on {measured}, not on {s.gpu_arch}"
    return None


def _memory(c: Candidate, env: str | None, s: Scenario) -> tuple[float, str]:
    """Memory the artifact needs to serve, and where the number comes from. Served on a GPU the
    measured peaks say little (the GPU's is the engine's reservation, a share of the whole GPU; the
    host's RSS is not where the weights live): the weights and the 16-bit KV cache of the scenario's
    concurrent requests at the benchmark's context are what it needs at least, or, where the deploy
    command fixes the cache's size (llama-server's -c), the weights and that whole cache; sharded
    over tp_size GPUs, each GPU's share of it (what `--memory-gib` is compared with on a GPU host).
    On a CPU host: the serving benchmark's peak RSS, else its validation's."""
    bound = (c.serving or {}).get("decode_bound") or {}
    if c.serving and not _serving_device(c).startswith("cpu"):
        need, basis = _gpu_need(c, bound, s)
        if c.tp_size > 1:
            return need / c.tp_size / MIB, f"per GPU, 1/{c.tp_size} of the {basis} (tp_size {c.tp_size})"
        return need / MIB, basis
    levels = (c.serving or {}).get("levels") or {}
    peaks = [lv["peak_rss_mib"] for lv in levels.values() if lv.get("peak_rss_mib")]
    if peaks and c.device.startswith("cpu"):
        return max(peaks), "serving benchmark peak RSS"
    validate = [st.peak_rss_mib for st in c.steps if st.op == "validate" and st.env == env]
    if validate and c.device.startswith("cpu"):
        return max(validate), "peak RSS of its validation in this engine"
    return c.size_bytes / MIB, "weights' size (a lower bound: no serving memory measured)"


def _gpu_need(c: Candidate, bound: dict[str, Any], s: Scenario) -> tuple[float, str]:
    """Bytes a GPU-served artifact needs over all its GPUs, and what they count: the share of them
    its deploy command puts on the GPU where it keeps some layers in host memory (llama.cpp's -ngl;
    each layer's KV cache lives with it)."""
    need, basis = _whole_gpu_need(c, bound, s)
    share = bound.get("gpu_layer_share")
    if share is None:
        return need, basis
    return (
        need * share,
        f"{share:.0%} of the {basis}: the share of its layers its deploy command puts on the GPU",
    )


def _whole_gpu_need(c: Candidate, bound: dict[str, Any], s: Scenario) -> tuple[float, str]:
    """Bytes the artifact needs with every layer on the GPU(s), and what they count."""
    allocated = _kv_allocated_at_start(c)
    if allocated is not None and bound.get("kv_bytes"):
        tokens, setting = allocated
        return c.size_bytes + bound["kv_bytes"] / bound["context_tokens"] * tokens, (
            f"weights + 16-bit KV cache of the {tokens:,} tokens its deploy command allocates at "
            f"start ({setting}; a lower bound: the engine's compute buffers not counted)"
        )
    if bound.get("kv_bytes"):
        return c.size_bytes + bound["kv_bytes"] * s.concurrency, (
            f"weights + 16-bit KV cache of {s.concurrency} x {bound['context_tokens']} tokens "
            "(a lower bound: the engine's own buffers not counted)"
        )
    return c.size_bytes, "weights' size (a lower bound: served on a GPU, no KV figure)"


def _kv_allocated_at_start(c: Candidate) -> tuple[int, str] | None:
    """The KV cache tokens its deploy command allocates whatever the scenario (an engine whose
    command sizes it, llama-server's -c), with the setting that did, as its server logged them;
    None where the engine sizes it from the host's memory or nothing was logged."""
    engine = ENGINES.get(c.engine)
    kv = (c.serving or {}).get("kv_cache") or {}
    if engine is None or not engine.kv_sized_by_command or not kv.get("tokens"):
        return None
    setting = ((c.serving or {}).get("memory_setting") or {}).get(engine.memory_knob or "")
    return int(kv["tokens"]), f"{engine.memory_knob} {setting}" if setting is not None else "logged"


def select(registry: Registry, scenario: Scenario) -> dict[str, Any]:
    """{"scenario", "ranked": [...best first], "excluded": [...with why]} for `scenario`."""
    if scenario.objective not in OBJECTIVES:
        raise RegistryError(f"unknown objective {scenario.objective!r} (known: {', '.join(OBJECTIVES)})")
    if scenario.cpu and scenario.gpu_arch:
        raise RegistryError("--cpu and --gpu-arch exclude each other: choose the host the job runs on")
    found = candidates(registry, scenario.model)
    if not found:
        scope = f" of model {scenario.model}" if scenario.model else ""
        raise RegistryError(f"no validated artifact{scope} in the registry (try `pipeline registry list`)")
    shape = _shape(scenario.workload)
    ranked, excluded = [], []
    for c in found:
        c.serving = _at_workload(c.serving, shape)
        env = ENGINES[c.engine].env if c.engine in ENGINES else None
        c.memory_mib, c.memory_from = _memory(c, env, scenario)
        c.excluded = c.excluded or _exclusion(c, scenario)
        if c.excluded:
            excluded.append(c)
            continue
        c.reasons = _reasons(c, scenario)
        ranked.append(c)
    by_kld = False
    if scenario.objective == "accuracy":
        by_kld = all(c.kld_mean is not None for c in ranked)
        for c in ranked:
            c.reasons.append(_accuracy_basis(c, by_kld))
    # among levels a time cap cut: speed by what each server streamed inside its cap, where every
    # cut one recorded it (from 2026-12-07), else by the finished requests' tokens alone
    cut = [(c, lv) for c in ranked if (lv := _level(c, scenario) or {}).get("incomplete")]
    by_streamed = bool(cut) and all(lv.get("streamed_tokens_per_s") is not None for _, lv in cut)
    if by_streamed and scenario.objective == "throughput":
        for c, _ in cut:
            c.reasons.append("ranked among the cut levels by what each streamed inside its cap")
    ranked.sort(key=lambda c: _rank_key(c, scenario, by_kld, by_streamed))
    return {
        "scenario": asdict(scenario),
        "ranked": [c.as_dict() for c in ranked],
        "excluded": [c.as_dict() for c in excluded],
    }


def _shape(workload: str | None) -> str | None:
    """The workload "2048/256" (or "2048x256") as workload_shape spells it; None stays None."""
    if workload is None:
        return None
    prompt, sep, output = workload.replace("x", "/").partition("/")
    if not (sep and prompt.isdigit() and output.isdigit()):
        raise RegistryError(f"--workload {workload!r}: expected PROMPT/OUTPUT tokens, e.g. 2048/256")
    return f"{int(prompt)}/{int(output)}"


def _at_workload(serving: dict[str, Any] | None, shape: str | None) -> dict[str, Any] | None:
    """The serving record with the numbers of workload `shape` in its first workload's place (the
    recipe's more_workloads ran on the same server after it); a record without that shape says so."""
    if not serving or shape is None or serving.get("status") != STATUS_PASSED:
        return serving
    first = serving.get("workload") or {}
    if "prompt_tokens" in first and workload_shape(first) == shape:
        return serving
    for run in serving.get("more_workloads") or []:
        if workload_shape(run["workload"]) == shape:
            keys = ("workload", "status", "reason", "levels", "decode_bound")  # WorkloadRun's, all dumped
            return {**serving, **{k: run[k] for k in keys}}
    loads = [first, *(run["workload"] for run in serving.get("more_workloads") or [])]
    measured = [workload_shape(w) for w in loads if "prompt_tokens" in w]
    said = f"measured at {', '.join(measured)} tokens" if measured else "its serving record names no workload"
    return {**serving, "status": "not run", "levels": {}, "reason": f"{said}, not {shape}"}


def _exclusion(c: Candidate, s: Scenario) -> str | None:
    """Why `c` does not fit `s` (None: it fits)."""
    if s.cpu and not c.device.startswith("cpu"):
        return f"validated on {c.device}, not on a CPU"
    if s.gpu_arch and c.gpu_arch not in (None, s.gpu_arch):
        return f"built for {c.gpu_arch}, not {s.gpu_arch}"
    if s.gpus is not None and c.tp_size > s.gpus:
        return f"sharded over {c.tp_size} GPUs (tp_size), the host has {s.gpus}"
    if s.max_ppl_delta is not None:
        if c.ppl_delta_pct is None:
            return "no ΔPPL measured"
        if c.ppl_delta_pct > s.max_ppl_delta:
            return f"ΔPPL {c.ppl_delta_pct:+.2f} % > {s.max_ppl_delta} %"
    if s.memory_gib is not None and c.memory_mib is not None and c.memory_mib > s.memory_gib * 1024:
        return f"needs {c.memory_mib:.0f} MiB ({c.memory_from}) > {s.memory_gib} GiB"
    level = _level(c, s)
    wants_serving = (
        s.max_ttft_ms is not None or s.max_itl_ms is not None or s.objective in ("throughput", "latency")
    )
    if wants_serving and level is None:
        return f"no serving numbers at concurrency {s.concurrency} ({_serving_state(c, s)})"
    if level is not None:
        limited = s.max_ttft_ms is not None or s.max_itl_ms is not None
        if limited and (level.get("ttft_ms_p99") is None or level.get("itl_ms_p99") is None):
            return (
                f"no request finished at concurrency {s.concurrency} inside its time cap: no latency to bound"
            )
        if s.max_ttft_ms is not None and level["ttft_ms_p99"] > s.max_ttft_ms:
            return (
                f"TTFT p99 {level['ttft_ms_p99']:.0f} ms > {s.max_ttft_ms} ms at concurrency {s.concurrency}"
            )
        if s.max_itl_ms is not None and level["itl_ms_p99"] > s.max_itl_ms:
            itl = level["itl_ms_p99"]
            return f"ITL p99 {itl:.1f} ms > {s.max_itl_ms} ms at concurrency {s.concurrency}"
    return None


def _serving_state(c: Candidate, s: Scenario) -> str:
    if not c.serving:
        return "the serving benchmark did not run for this engine"
    if c.serving.get("status") != STATUS_PASSED:
        return f"its serving benchmark {c.serving.get('status')}: {c.serving.get('reason')}"
    elsewhere = _measured_elsewhere(c, s)
    if elsewhere:
        return elsewhere
    return f"measured at concurrency {', '.join(sorted(c.serving.get('levels') or {}))} only"


def _reasons(c: Candidate, s: Scenario) -> list[str]:
    reasons = []
    if c.ppl_delta_pct is not None:
        reasons.append(f"ΔPPL {c.ppl_delta_pct:+.2f} %")
    reasons.append(f"{c.size_bytes / MIB:.0f} MiB on disk")
    if c.memory_mib is not None:
        reasons.append(f"{c.memory_mib / 1024:.2f} GiB to serve ({c.memory_from})")
    level = _level(c, s)
    if level is not None:
        workload = (c.serving or {}).get("workload") or {}
        shape = f" of {workload_shape(workload)} tokens" if "prompt_tokens" in workload else ""
        latency = (  # none: the time cap ended the level before any request finished
            f", TTFT p99 {level['ttft_ms_p99']:.0f} ms, ITL p99 {level['itl_ms_p99']:.1f} ms"
            if level.get("ttft_ms_p99") is not None and level.get("itl_ms_p99") is not None
            else ", no request finished"
        )
        reasons.append(
            f"at concurrency {s.concurrency}{shape} on {_serving_device(c)}: "
            f"{level['output_tokens_per_s']:.1f} output tokens/s{latency}"
        )
        bound = (c.serving or {}).get("decode_bound") or {}
        if s.concurrency == 1 and bound.get("share_c1") is not None:
            reasons.append(
                f"{bound['share_c1']:.0%} of its {bound['bound_tokens_per_s']:.0f} tokens/s bandwidth bound"
                + (f" ({bound['flag']})" if bound.get("flag") else "")
            )
        others = level.get("others_cpu_share")
        if others is not None and others > CONTENDED_SHARE:
            reasons.append(
                f"CONTENDED: other processes used {others:.0%} of the host's CPUs during that benchmark; "
                "rebuild it with the host to itself (`pipeline build --force`) for clean numbers"
            )
        if level.get("incomplete"):
            finished = level["completed"] + level["errored"]
            streamed = level.get("streamed_tokens_per_s")  # recorded from 2026-12-07
            inside = (
                f" (the server streamed {streamed:.1f} tokens/s inside it, cut requests included)"
                if streamed is not None
                else ""
            )
            reasons.append(
                f"CUT: the level's time cap ended it with {finished} of {level.get('planned') or '?'} "
                f"requests finished; its tokens/s counts only those over the whole window{inside} (raise "
                "serving_benchmark.max_seconds_per_level and rebuild); ranked after every whole level"
            )
    return reasons


def _accuracy_basis(c: Candidate, by_kld: bool) -> str:
    """What the accuracy ranking read for this candidate."""
    if by_kld:
        return f"accuracy ranked by full-vocabulary KLD to the reference: {c.kld_mean:.4f}"
    return (
        "accuracy ranked by |ΔPPL| (not every candidate has a full-vocabulary KLD: vLLM's and SGLang's "
        "verdicts hold only a top-k lower bound)"
    )


def _rank_key(
    c: Candidate, s: Scenario, by_kld: bool = False, by_streamed: bool = False
) -> tuple[float, ...]:
    """Best first; ties broken by ΔPPL, then size. For speed, a level its time cap cut comes after
    every whole one: its numbers count only the requests that finished, so they compare with
    nothing; among cut ones, by what each streamed inside its cap where all have it (`by_streamed`).
    Accuracy: by full-vocabulary KLD where every candidate has one (`by_kld`; ΔPPL's sign
    and size are noise at small deltas, and a quantization can score a lower PPL than its source
    while its distributions moved), else by |ΔPPL|."""
    ppl = c.ppl_delta_pct if c.ppl_delta_pct is not None else float("inf")
    level = _level(c, s) or {}
    cut = 1.0 if level.get("incomplete") else 0.0

    def measured(key: str, missing: float) -> float:  # None: a cut level where nothing finished
        value = level.get(key)
        return missing if value is None else value

    if s.objective == "throughput":
        rate = "streamed_tokens_per_s" if cut and by_streamed else "output_tokens_per_s"
        return (cut, -measured(rate, 0.0), ppl, c.size_bytes)
    if s.objective == "latency":
        return (cut, measured("ttft_ms_p99", float("inf")), measured("itl_ms_p99", float("inf")), ppl)
    if s.objective == "size":
        return (c.size_bytes, ppl)
    if by_kld and c.kld_mean is not None:
        return (c.kld_mean, abs(ppl), c.size_bytes)
    return (abs(ppl), c.size_bytes)
