"""GPU build-host benchmark: `pipeline build` step by step next to each tool called directly.

Prints numbers and writes them as JSON rows + a markdown table (benchmarks/results/). For every
target named: `pipeline build RECIPE --targets T` in its own process, as a build server runs it;
each step's wall time, peak RSS (its process group) and peak GPU memory come from the manifest's
`build.steps`. Then the same step run by the tool itself (benchmarks/raw_tools.py, same settings,
same environment, same session) under the same sampler, and the ratio project/raw.

    python benchmarks/bench_gpu.py make-checkpoint DIR --arch qwen2|llama --tokenizer SRC [--shape S]
    python benchmarks/bench_gpu.py run RECIPE --targets awq,gptq --model NAME --json OUT.json
    python benchmarks/bench_gpu.py warm MODEL_DIR --model NAME --json OUT.json
    python benchmarks/bench_gpu.py close OUT.json --manifests M.json... --reason WHY

`make-checkpoint` writes a known model's shapes (`--shape`: qwen2-7b, the default, qwen2.5-32b or
llama2-70b; pipeline.constants.KNOWN_HUB_CONFIGS) with random bfloat16 weights, initialised on the
GPU (several GPUs, whole layers each, for a model one cannot hold) at a scale that keeps float16
activations in range (`scaled_init`, checked by a float16 forward pass), and SRC's tokenizer;
`--arch llama` declares the same shapes as a Llama (llama.cpp's converter refuses SmolLM2's
tokenizer under Qwen2: "BPE pre-tokenizer was not recognized"). `close`, here on collected files,
gives a run the lease ended after its manifests but before its raw `serve` step their serving rows:
the project's side from each manifest, the raw side `not run` with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.constants import (  # noqa: E402
    ENGINES,
    ENV_GUIDELLM,
    GGUF_BASE_OUTTYPE,
    GGUF_FILE,
    GGUF_QUANTS,
    LLAMA_SERVER,
)
from pipeline.decode_bound import checkpoint_weights_read, decode_bound, kv_bytes_per_context_token  # noqa: E402
from pipeline.engines.serving import ARTIFACT_DIR, free_port, local_argv  # noqa: E402
from pipeline.environments import UsageSampler, environment, local_gpu_name, run_step  # noqa: E402
from pipeline.errors import PipelineError  # noqa: E402
from pipeline.project import Project  # noqa: E402
from pipeline.serving import (  # noqa: E402
    engine_mode,
    load_request,
    load_timeout_s,
    server_log_text,
    tokenizer_dir,
)
from pipeline.spec import workload_shape  # noqa: E402

RAW = REPO / "benchmarks" / "raw_tools.py"


# Scaled initialisation of a random checkpoint: unit-variance projections of the normed hidden state,
# residual branches scaled by 1/sqrt(2 x layers) so the residual stream stays O(1) over all layers
# (GPT-2's rule), and logits of standard deviation LOGIT_STD, about a trained model's, so greedy
# steps are not all near-ties. transformers' default (every Linear N(0, 0.02)) grows the MLP's
# output with the width (0.02 x sqrt(18944) ~ 2.8 per layer at 7B shape), and llm-compressor's AWQ
# grid search in float16 found no finite loss on it.
LOGIT_STD = 3.0
RESIDUAL_OUT = ("o_proj", "down_proj")


def scaled_init(model: Any, seed: int = 0) -> None:
    """Re-initialise `model`'s weights in place (see LOGIT_STD above); norms 1, biases 0. Every
    parameter is written (a model made with uninitialised memory, `to_empty`, is whole after it);
    one generator per device, seeded alike."""
    import torch

    cfg = model.config
    gens: dict[Any, Any] = {}

    def gen_for(t: Any) -> Any:
        if t.device not in gens:
            gens[t.device] = torch.Generator(device=t.device).manual_seed(seed)
        return gens[t.device]

    residual = 1.0 / (2 * cfg.num_hidden_layers) ** 0.5
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Embedding):
                module.weight.normal_(0.0, 1.0, generator=gen_for(module.weight))
            elif isinstance(module, torch.nn.Linear):
                std = 1.0 / module.in_features**0.5
                if name.endswith(RESIDUAL_OUT):
                    std *= residual
                elif name.endswith("lm_head"):
                    std *= LOGIT_STD
                module.weight.normal_(0.0, std, generator=gen_for(module.weight))
                if module.bias is not None:
                    module.bias.zero_()
            elif "norm" in type(module).__name__.lower() and getattr(module, "weight", None) is not None:
                module.weight.fill_(1.0)


def activation_ranges(model: Any, ids: list[int], dtype: Any) -> dict[str, float]:
    """The largest |activation| a forward pass at `dtype` reaches: each decoder layer's output, the
    MLP's down_proj input, and the logits; they must stay finite and far below float16's 65504."""
    import torch

    peaks: dict[str, float] = {}

    def keep(key: str) -> Any:
        def hook(_m: Any, inputs: Any, output: Any) -> None:
            t = inputs[0] if key.endswith("down_in") else (output[0] if isinstance(output, tuple) else output)
            peaks[key] = max(peaks.get(key, 0.0), float(t.detach().abs().float().max()))

        return hook

    layers = model.model.layers
    handles = [layers[i].register_forward_hook(keep("layer_out")) for i in range(len(layers))]
    handles += [layers[i].mlp.down_proj.register_forward_hook(keep("down_in")) for i in range(len(layers))]
    try:
        with torch.no_grad():
            logits = model.to(dtype)(torch.tensor([ids], device=model.device)).logits
        peaks["logits"] = float(logits.abs().float().max())
        peaks["logits_std"] = float(logits.float().std())
        peaks["finite"] = float(bool(torch.isfinite(logits).all()))
    finally:
        for h in handles:
            h.remove()
    return peaks


def layer_placement(n_layers: int, devices: list[str]) -> dict[str, str]:
    """Whole modules of a decoder over `devices` (accelerate's device_map form): the embedding and
    RoPE with the first layers, the final norm and lm_head with the last, layers in equal runs."""
    per = -(-n_layers // len(devices))
    placement = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0]}
    placement |= {f"model.layers.{i}": devices[i // per] for i in range(n_layers)}
    return placement | {"model.norm": devices[-1], "lm_head": devices[-1]}


def random_model(cfg: Any, devices: list[str]) -> Any:
    """`cfg`'s model in bfloat16 with scaled_init's weights, made where it will run: on one device,
    or (a model one GPU cannot hold) spread over `devices` whole layers at a time, each module made
    straight on its device (never the whole model in host memory) and dispatched (accelerate) so a
    forward pass crosses them."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if len(devices) == 1:
        with torch.device(devices[0]):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    else:
        from accelerate import dispatch_model

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        placement = layer_placement(cfg.num_hidden_layers, devices)
        for name, device in placement.items():
            model.get_submodule(name).to_empty(device=device)
        # RoPE's inverse frequencies are a buffer computed when made: make it again, on its device
        rotary = model.model.rotary_emb
        with torch.device(placement["model.rotary_emb"]):
            model.model.rotary_emb = type(rotary)(config=cfg)
        model = dispatch_model(model, device_map=placement)
    scaled_init(model)
    return model


def gpu_devices(n_params: int) -> list[str]:
    """Where make-checkpoint makes a model: the first GPU when it holds the bfloat16 weights with a
    quarter to spare, else as many GPUs as it takes (each filled to three quarters); the CPU
    without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return ["cpu"]
    need = n_params * 2
    free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
    taken, devices = 0.0, []
    for i, f in enumerate(free):
        devices.append(f"cuda:{i}")
        taken += 0.75 * f
        if taken >= need:
            return devices
    raise SystemExit(f"{need / 2**30:.0f} GiB of bfloat16 weights exceed 3/4 of the GPUs' free memory")


def disk_shortfall(need: int, directory: Path) -> str | None:
    """Why a checkpoint of `need` bytes does not fit under `directory` (its filesystem's free space,
    with 5 % to spare), or None. The device's disk is 64 GiB: a 32B shape's 61 GiB do not fit
    beside the carried environments, and a save that fills it half-way costs the lease."""
    free = shutil.disk_usage(directory).free
    if need * 1.05 <= free:
        return None
    return (
        f"{need / 2**30:.1f} GiB of bfloat16 weights, {free / 2**30:.1f} GiB free under {directory}: not "
        "made (run_h200.sh: CHECKPOINT_ROOT=/dev/shm makes the checkpoint in memory)"
    )


def make_checkpoint(out: Path, arch: str, tokenizer: Path, shape: str = "qwen2-7b") -> None:
    import torch
    from bench_trtllm_checkpoint import shape_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.constants import BUILTIN_TEXTS

    tok = AutoTokenizer.from_pretrained(tokenizer)
    cfg = shape_config(
        shape,
        arch,
        rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    if len(tok) > cfg.vocab_size:  # Llama-2's 32,000 rows are fewer than SmolLM2's tokenizer has
        print(f"vocab_size {cfg.vocab_size} -> {len(tok)}: the tokenizer's ids must all have a row")
        cfg.vocab_size = len(tok)
    t0 = time.perf_counter()
    with torch.device("meta"):  # counted without memory
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    out.parent.mkdir(parents=True, exist_ok=True)
    if short := disk_shortfall(n_params * 2, out.parent):  # said before minutes of making it
        raise SystemExit(f"{shape}: {short}")
    model = random_model(cfg, gpu_devices(n_params))
    text = (REPO / "pipeline" / "data" / BUILTIN_TEXTS["gpl-3.0"]).read_text()
    ids = tok(text, add_special_tokens=False)["input_ids"][:512]
    ranges = activation_ranges(model, ids, torch.float16)
    print(f"float16 forward of {len(ids)} tokens, largest |activation|: {json.dumps(ranges)}")
    if not ranges["finite"] or max(v for k, v in ranges.items() if k != "logits_std") > 6e4:
        raise SystemExit("the scaled checkpoint overflows float16: not written")
    model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out, max_shard_size="4GB")
    tok.save_pretrained(out)
    (out.parent / f"{out.name}.activations.json").write_text(json.dumps(ranges, indent=1) + "\n")
    n = sum(p.numel() for p in model.parameters())
    print(f"{out}: {arch} {n / 1e9:.2f}B parameters, written in {time.perf_counter() - t0:.0f}s")


def sampled(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `cmd` in its own session under the pipeline's step sampler: seconds, peaks, exit code."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=sys.stderr, stderr=sys.stderr)
    with UsageSampler(proc.pid) as sampler:
        proc.wait()
    return {
        "seconds": round(time.perf_counter() - t0, 2),
        "peak_rss_mib": round(sampler.peak_rss / 2**20, 1),
        "peak_gpu_mib": sampler.peak_gpu_mib,
        "rc": proc.returncode,
    }


def raw_step(env_name: str, tool: str, request: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run one raw tool step; its output (under `work`) is deleted afterwards, except a raw F16
    base that a raw quantize reads next."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(request, f)
    try:
        return sampled([environment(env_name).interpreter, str(RAW), tool, f.name])
    finally:
        os.unlink(f.name)
        for key in ("out_dir", "out_path"):
            out = Path(request.get(key) or work)
            if out.parent == work and out.name != "raw-base.gguf":
                if out.is_dir():
                    shutil.rmtree(out, ignore_errors=True)
                else:
                    out.unlink(missing_ok=True)


def raw_requests(
    project: Project, target: str, work: Path, with_validate: bool = True
) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(pipeline step op, env, raw tool, request) for each step of `target` a tool can run alone with
    the same settings (`with_validate` False: only the steps before validation, which need neither
    the reference nor the built artifact). Not repeated: quantizing with an imatrix (the pipeline
    hands llama.cpp its own imatrix through the C API; there is no raw tool for that here) and
    ModelOpt other than FP8."""
    from pipeline.targets.gguf import BASE_FILE, GgufTarget
    from pipeline.targets.int4 import BACKENDS, Int4Target
    from pipeline.targets.modelopt import ModeloptTarget, checkpoint_request
    from pipeline.workers.llamacpp import llama_cpp_dir

    ctx = project.context()
    spec = project.loaded.recipe.targets[target]
    r = project.loaded.recipe
    out = work / f"raw-{target}"
    steps: list[tuple[str, str, str, dict[str, Any]]] = []
    if isinstance(spec, GgufTarget):
        # the pipeline's own F16 base (cached: shared by every GGUF target), else a raw convert's
        cached = project.layout.cache_dir / f"gguf-base-{GGUF_BASE_OUTTYPE}" / BASE_FILE
        base = cached if cached.is_file() else work / "raw-base.gguf"
        convert = {
            "llama_cpp_dir": str(llama_cpp_dir()),
            "model_dir": str(ctx.source.path),
            "out_path": str(base),
            "outtype": "f16",
        }
        steps.append(("convert", "llamacpp", "convert", {**convert, "out_path": str(work / "raw-base.gguf")}))
        stage, ftype = GGUF_QUANTS[spec.quant]
        if stage == "quantize" and not spec.imatrix:
            steps.append(
                (
                    "quantize",
                    "llamacpp",
                    "quantize",
                    {"in_path": str(base), "out_path": str(out) + ".gguf", "ftype": ftype},
                )
            )
        return steps
    if isinstance(spec, Int4Target):
        env = BACKENDS[spec.backend][0]  # llmcompressor or gptqmodel: the raw tool of the same name
        steps.append(("quantize", env, env, spec.quantize_request(ctx, ctx.source.path, out)))
    elif isinstance(spec, ModeloptTarget) and spec.quant == "fp8":
        request = checkpoint_request(
            ctx, out, export="hf", quant=spec.quant, dtype=spec.dtype, calibration=spec.calibration
        )
        steps.append(("checkpoint", "modelopt", "modelopt", request))
    else:
        return steps
    if not with_validate:
        return steps
    ref, _ = ctx.reference()
    built = project.layout.target_dir(target)
    steps.append(
        (
            "validate",
            "vllm",
            "vllm",
            {
                "model_dir": str(built),
                "dtype": spec.dtype,
                "reference": ref,
                "max_new_tokens": r.smoke.max_new_tokens,
                "gpu_memory_utilization": r.serve.vllm.gpu_memory_utilization,
            },
        )
    )
    return steps


def warm(model_dir: Path, model: str, json_out: Path, attention_backend: str) -> None:
    """The first start of vLLM and SGLang on this host (their JIT and autotune caches filled for the
    builds that follow), recorded as rows of their own: what a fresh build server pays once."""
    rows = json.loads(json_out.read_text()) if json_out.is_file() else []
    for engine in ("vllm", "sglang"):
        env = environment(engine)
        if not env.exists:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            request = {
                "engine": engine,
                "model_dir": str(model_dir),
                "dtype": "bfloat16",
                "attention_backend": attention_backend,
                "result_path": str(result),
            }
            measured = raw_step(engine, "first-start", request, Path(tmp))
            times = json.loads(result.read_text()) if result.is_file() else {}
        row = {"target": "first-start", "model": model, "engine": engine, "device": _device()}
        row |= {"status": "passed" if measured["rc"] == 0 else "error", **times, **measured}
        print(json.dumps(row))
        rows.append(row)
        write_results(json_out, rows)


def run(
    recipe: Path,
    targets: list[str],
    model: str,
    json_out: Path,
    raw_ops: list[str],
    settings: list[str] | None = None,
) -> None:
    project = Project.open(recipe)
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    try:
        run_targets(project, recipe, targets, model, json_out, raw_ops, work, settings)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_targets(
    project: Project,
    recipe: Path,
    targets: list[str],
    model: str,
    json_out: Path,
    raw_ops: list[str],
    work: Path,
    settings: list[str] | None = None,
) -> None:
    device = _device()
    rows = json.loads(json_out.read_text()) if json_out.is_file() else []
    for index, target in enumerate(targets):
        # Alternate which side runs first (page cache, JIT caches, GPU clocks favour the second):
        # every other target runs its raw build steps before `pipeline build`.
        raw_first = index % 2 == 1
        early: list[tuple[str, dict[str, Any]]] = []
        if raw_first:
            for op, env_name, tool, request in raw_requests(project, target, work, with_validate=False):
                if op in raw_ops and op != "convert":
                    early.append((f"{env_name}:{op}", raw_step(env_name, tool, request, work)))
        started = time.time()
        argv = build_argv(recipe, target, raw_ops)
        whole = sampled(argv)
        manifest_path = project.layout.target_dir(target) / "manifest.json"
        if not this_builds_manifest(manifest_path, started, argv, whole["rc"]):
            rows.append(
                {
                    "target": target,
                    "model": model,
                    "device": device,
                    "status": "error",
                    "reason": f"pipeline build exited {whole['rc']}",
                    "seconds": whole["seconds"],
                }
            )
            write_results(json_out, rows)
            continue
        m = json.loads(manifest_path.read_text())
        v = m["validation"]
        steps = m["build"]["steps"]
        raw: list[dict[str, Any]] = []  # filled below; every engine row of this target shares it
        for engine, verdict in v["engines"].items():
            vm = verdict.get("metrics") or {}
            details = verdict.get("details") or {}
            rows.append(
                {
                    "target": target,
                    "model": model,
                    "engine": engine,
                    "engine_version": verdict.get("engine_version"),
                    "device": device,
                    "status": verdict["status"],
                    "reason": verdict.get("reason"),
                    "quant": m["quant"],
                    "library": (m.get("quantization") or {}).get("library"),
                    "kernels": _kernels(project.layout.logs_dir, target, engine),
                    "size_mib": round(sum(f["bytes"] for f in m["files"]) / 2**20, 1),
                    "ppl_delta_pct": vm.get("ppl_delta_pct"),
                    "kld": vm.get("kld_mean") if vm.get("kld_mean") is not None else vm.get("kld_topk_mean"),
                    "kld_metric": "kld_mean" if vm.get("kld_mean") is not None else "kld_topk_mean",
                    "token_agreement": vm.get("token_agreement"),
                    "tokens_per_s": vm.get("tokens_per_s"),
                    "serve_check": details.get("serve_check", {}).get("ok"),
                    "serve_check_modes": details.get("serve_check", {}).get("modes"),
                    "seconds": whole["seconds"],
                    "build_seconds": m["build"]["seconds"],
                    "peak_rss_mib": max((s["peak_rss_mib"] for s in steps), default=None),
                    "peak_gpu_mib": whole["peak_gpu_mib"],
                    "reference": v.get("reference"),
                    "steps": steps,
                    "raw": raw,
                    "raw_order": "raw first" if raw_first else "project first",
                    "primary": engine == v["engine"],
                }
            )
        write_results(json_out, rows)  # now, and after every raw step: a run killed later keeps them

        for step, measured in early:
            raw.append(raw_row(step, measured, steps, target))
            write_results(json_out, rows)
        done = {step for step, _ in early}
        for op, env_name, tool, request in raw_requests(project, target, work):
            if op not in raw_ops or f"{env_name}:{op}" in done:
                continue
            if op == "convert" and not any(s["op"] == "convert" for s in steps):
                continue  # the pipeline reused its cached base: nothing to compare with
            raw.append(raw_row(f"{env_name}:{op}", raw_step(env_name, tool, request, work), steps, target))
            write_results(json_out, rows)
        # each engine the build benchmarked (serving_benchmark.engines), and the primary row always:
        # where nothing was benchmarked, its record says why
        mine = rows[-len(v["engines"]) :]
        served = [row for row in mine if row["primary"] or row["engine"] in (m.get("serving") or {})]
        # in the order asked (`settings,serve`: the settings first, where the lease may end mid-way;
        # `serve:sglang,serve:vllm`: one engine's, then the other's)
        for op, engine in [named for named in map(serving_op, raw_ops) if named[0]]:
            for row in [row for row in served if engine in (None, row["engine"])]:
                if op == "serve":  # beside the engine called with its defaults
                    row["serving"] = serving_rows(project, target, m, row["engine"])
                else:  # one engine setting changed at a time

                    def keep(partial: dict[str, Any], row: dict[str, Any] = row) -> None:
                        row["settings"] = partial
                        write_results(json_out, rows)

                    row["settings"] = setting_rows(project, target, m, row["engine"], keep, settings)
                write_results(json_out, rows)
        if not any(serving_op(op)[0] for op in raw_ops):  # no raw server asked (R=none, build steps)
            for row in served:
                row["serving"] = project_side_only(m, row["engine"], NO_RAW_SERVE)
            write_results(json_out, rows)
    print(markdown(rows))


NO_RAW_SERVE = "this run asked for no raw serve step (its raw steps name no `serve`)"


def project_side_only(manifest: dict[str, Any], engine: str, reason: str) -> dict[str, Any]:
    """`engine`'s serving record from the manifest with its raw side `not run` for `reason` (nothing
    measured is made up), or why it has none."""
    ours = (manifest.get("serving") or {}).get(engine) or {}
    if ours.get("status") != "passed":
        return not_benchmarked(ours)
    return serving_record(ours, {"status": "not run", "reason": reason})


def build_argv(recipe: Path, target: str, raw_ops: list[str]) -> list[str]:
    """`pipeline build` of one target: `--force` (every file made anew) where the run compares build
    steps with the raw tools; a serving-only run (`none`, `serve`, `settings`) builds as a build
    server would, keeping verified files whose own inputs did not move (2026-12-07: a changed
    CONCURRENCY quantized Q4_0 again; an IQ4_XS quantize is ~127 s of a lease; the kept files are
    still copies, so a full disk fails either way), an up-to-date artifact's numbers standing
    (measured on this host: the kit's work directory is the lease's)."""
    argv = [sys.executable, "-m", "pipeline", "build", str(recipe), "--targets", target]
    return [*argv, "--force"] if any(serving_op(op)[0] is None for op in raw_ops) else argv


def this_builds_manifest(path: Path, started: float, argv: list[str], rc: int) -> bool:
    """Whether `path` is what the build `argv` (begun at `started`, exit code `rc`) left: written by
    it, or, without --force, an up-to-date artifact's (exit 0); not one a failed build left behind."""
    if not path.is_file():
        return False
    return path.stat().st_mtime >= started or ("--force" not in argv and rc == 0)


def serving_op(op: str) -> tuple[str | None, str | None]:
    """A raw step `serve` or `settings` (every benchmarked engine) or `serve:ENGINE` (that engine's
    only) as (op, engine); (None, None) for any other step."""
    name, _, engine = op.partition(":")
    return (name, engine or None) if name in ("serve", "settings") else (None, None)


def raw_steps_error(raw_ops: list[str]) -> str | None:
    """Why a --raw-steps list would do less than it says (None: it would not): an engine name
    not known, or an engine's serving step named twice (`serve` and `serve:sglang`)."""
    seen: dict[str, set[str | None]] = {}
    for op in raw_ops:
        name, engine = serving_op(op)
        if name is None:
            continue
        if engine is not None and engine not in ENGINES:
            return f"--raw-steps {op}: no engine {engine!r} (engines: {', '.join(sorted(ENGINES))})"
        named = seen.setdefault(name, set())
        if engine in named or (None in named) or (engine is None and named):
            return f"--raw-steps names {name} twice for one engine ({op})"
        named.add(engine)
    return None


def settings_error(names: list[str] | None) -> str | None:
    """Why a --settings list would try less than it names (None: it would not): a name no engine's
    SERVE_SETTINGS has."""
    known = {name for table in SERVE_SETTINGS.values() for name in table}
    unknown = [name for name in names or [] if name not in known]
    if unknown:
        return f"--settings {', '.join(unknown)}: no such setting (settings: {', '.join(sorted(known))})"
    return None


# The engines called directly with their defaults, on the same checkpoint and workload as the
# serving benchmark (issue 26: the project's serve command must reach 0.95x of it). llama-server's
# defaults place the layers (auto: all of them on a GPU they fit) and pick the slots (auto: 4, one
# KV cache they share, the model's whole context); SGLang's one non-default: Triton attention (its
# Hopper default, FlashAttention 3, is not in the carried sglang-kernel).
RAW_SERVERS = {
    "vllm": ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", ARTIFACT_DIR],
    "sglang": ["python", "-m", "sglang.launch_server", "--model-path", ARTIFACT_DIR,
               "--attention-backend", "triton"],
    "llama.cpp": [LLAMA_SERVER, "-m", f"{ARTIFACT_DIR}/{GGUF_FILE}"],
}  # fmt: skip


def raw_serving(project: Project, engine: str, model_dir: Path, log: Path) -> dict[str, Any]:
    """GuideLLM at the recipe's serving workloads against `engine`'s own server with its defaults on
    `model_dir` (the load generator and sampler pipeline.serving uses): per workload, its levels."""
    spec = project.loaded.recipe.serving_benchmark
    port = free_port()
    argv = [*RAW_SERVERS[engine], "--host", "127.0.0.1", "--port", str(port)]
    ctx = project.context()
    tokenizer = tokenizer_dir(ctx, model_dir)
    here = [ctx.program(ENGINES[engine].env, argv[0]), *argv[1:]]
    request = load_request(engine, here, 1, model_dir, tokenizer, spec, log.with_suffix(".server.log"), port)
    try:
        got = run_step(ENV_GUIDELLM, request, log, timeout_s=load_timeout_s(spec))
    except PipelineError as exc:  # the row records why; the run goes on
        return {"status": "failed", "reason": str(exc), "command": " ".join(argv)}
    runs = [
        {
            "workload": load,
            "levels": {str(lv["concurrency"]): lv for lv in run.get("levels", [])},
            "reason": run.get("error"),
        }
        for load, run in zip(spec.workloads(), got["runs"], strict=True)
    ]
    return {"status": "passed", "command": " ".join(argv), "workloads": runs}


LEVEL_KEYS = (
    "output_tokens_per_s", "streamed_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99",
    "peak_gpu_mib", "peak_rss_mib", "others_cpu_share", "output_tokens_mean", "planned", "incomplete",
    "completed", "errored",
)  # fmt: skip


def _rate(level: dict[str, Any] | None) -> float | None:
    """A level's output tokens/s to compare or to set against the bound; none where its time cap cut
    it (that counts finished requests over the whole window)."""
    return None if not level or level.get("incomplete") else level.get("output_tokens_per_s")


def _over(tps: float | None, base_tps: float | None) -> float | None:
    """One tokens/s figure over another, to 3 places (None where either is missing or zero)."""
    return round(tps / base_tps, 3) if tps and base_tps else None


def _ratio(got: dict[str, Any] | None, base: dict[str, Any] | None) -> float | None:
    """Output tokens/s of `got` over `base` (None where either has none)."""
    return _over(_rate(got), _rate(base))


def _streamed_ratio(got: dict[str, Any], base: dict[str, Any]) -> float | None:
    """Where a time cap cut either side of a level: the tokens each server streamed inside the
    same cap, over each other (None where neither was cut, or either has no such figure)."""
    if not (got.get("incomplete") or base.get("incomplete")):
        return None
    return _over(got.get("streamed_tokens_per_s"), base.get("streamed_tokens_per_s"))


def paired_levels(ours: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """Each level through the project's command beside the engine's own, and their tokens/s ratio
    (none where a time cap cut either side: there `streamed_ratio`, of what each streamed inside
    the cap)."""
    levels = {}
    for c, level in ours.items():
        other = raw.get(c) or {}
        levels[c] = {
            "project": {k: level.get(k) for k in LEVEL_KEYS},
            "raw": {k: other.get(k) for k in LEVEL_KEYS},
            "ratio": _ratio(level, other),
            "streamed_ratio": _streamed_ratio(level, other),
        }
    return levels


def _log_stem(target: str, engine: str, manifest: dict[str, Any]) -> str:
    """A raw step's log name: the target's for its primary engine, with the engine for another."""
    return target if engine == manifest["engine"] else f"{target}-{engine}"


def not_benchmarked(ours: dict[str, Any]) -> dict[str, Any]:
    """The serving record of an engine whose benchmark did not pass, or that has none."""
    if not ours:
        return {"status": "not run", "reason": "the build benchmarked no server of this engine "
                "(serving_benchmark's engines or targets leave it out, or it is off)"}  # fmt: skip
    return {"status": ours.get("status", "not run"), "reason": ours.get("reason")}


def serving_rows(project: Project, target: str, manifest: dict[str, Any], engine: str) -> dict[str, Any]:
    """`engine`'s serving benchmark of the artifact (its manifest) beside that engine called
    directly, per workload and level: output tokens/s, TTFT and ITL p50, peak GPU memory, the ratio
    project / raw."""
    ours = (manifest.get("serving") or {}).get(engine) or {}
    if ours.get("status") != "passed":
        return not_benchmarked(ours)
    log = project.layout.logs_dir / f"{_log_stem(target, engine, manifest)}-raw-serving.log"
    return serving_record(ours, raw_serving(project, engine, project.layout.target_dir(target), log))


def serving_record(ours: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """The project's passed serving record (a manifest's `serving.<engine>`) beside the raw side
    (raw_serving's result, or a `not run` one with its reason), per workload and level."""
    raw_runs = raw.get("workloads") or [{} for _ in range(1 + len(ours.get("more_workloads", [])))]
    workloads = []
    for run, raw_run in zip([ours, *ours.get("more_workloads", [])], raw_runs, strict=True):
        levels = paired_levels(run["levels"], raw_run.get("levels") or {})
        reason = run.get("reason") or raw_run.get("reason")  # a further workload that failed, either side
        workloads.append(
            {
                "workload": run["workload"],
                "decode_bound": run.get("decode_bound"),
                "levels": levels,
                "reason": reason,
            }
        )
    return {
        "status": "passed",
        "device": ours.get("device"),
        "memory_setting": ours.get("memory_setting"),
        "kv_cache": ours.get("kv_cache"),
        "engine_mode": ours.get("engine_mode"),  # its server's kernel and mode lines (none before 2026-12-07)
        "raw_command": raw.get("command"),
        "raw_status": raw["status"],
        "raw_reason": raw.get("reason"),
        "workloads": workloads,
    }


def close_rows(json_out: Path, manifests: list[Path], reason: str) -> None:
    """A run the lease ended before its raw `serve` step finished: each engine row of a target
    whose manifest was collected, and that has no serving record yet, gets the project's side from
    that manifest and a raw side `not run` with `reason` (nothing measured is made up). Writes
    the JSON file only."""
    rows = json.loads(json_out.read_text())
    by_target = {}
    for path in manifests:
        manifest = json.loads(path.read_text())
        by_target[manifest["target"]] = manifest
    for row in rows:
        manifest = by_target.get(row.get("target"))
        if manifest is None or row.get("serving") is not None or "engine" not in row:
            continue
        row["serving"] = project_side_only(manifest, row["engine"], reason)
    write_json(json_out, rows)  # not the .md beside it: in benchmarks/results/ it is the narrative


# Engine settings that may close concurrency 1's gap to the bandwidth bound (issue 26: "find it and
# say what it costs"): each is the project's serve command with that one change, measured at every
# level of the recipe's first workload, beside the command as it is in the same run.
# name -> (server environment, extra arguments).
SERVE_SETTINGS: dict[str, dict[str, tuple[dict[str, str], list[str]]]] = {
    "vllm": {
        # vLLM picks Machete for W4A16 on sm90; Marlin is its other kernel (the recipe's
        # serve.vllm.linear_backend). H100, 2026-12-05: +19 % at 1 stream, -37 % at 128. No
        # --async-scheduling row: vLLM 0.26 has it on by default (its row measured the same server).
        "marlin": ({}, ["--linear-backend", "marlin"]),
    },
    "sglang": {
        # the deploy command's Triton attention against FlashInfer's (carried with the sglang set):
        # H100, 2026-12-05, AWQ at 512/128 and 128 streams: SGLang's TTFT p50 was 2.1x vLLM's (2,889
        # against 1,360 ms), its ITL p50 1.4x (11.7 against 8.5 ms), its tokens/s 0.56x. Measured
        # 2026-12-07 (GPTQ): within 1.5 % of Triton at 8-128 streams; SGLang's W4A16 GEMM is Marlin
        # (h100-2026-12-07-serving-run4.md)
        "flashinfer attention": ({}, ["--attention-backend", "flashinfer"]),
        "torch.compile": ({}, ["--enable-torch-compile"]),
        # prefill chunks in the same batches as running decodes (SGLang's default runs them apart):
        # H100, 2026-12-07, AWQ at 2048/256, its throughput at 8-128 streams is c x 256 tokens over
        # c x 2,048 prefill tokens at ~21,700 tokens/s plus 256 decode steps, to 1 % (0.44x vLLM's at
        # 128, whose chunked prefill overlaps decoding; h100-2026-12-07-serving-run5.md)
        "mixed chunk": ({}, ["--enable-mixed-chunk"]),
    },
    "llama.cpp": {
        "flash attention on": ({}, ["-fa", "on"]),  # llama-server's default is auto
        # one KV cache all slots share (llama-server's default where it picks the slot count): a
        # slot may then hold more than n_ctx / parallel
        "unified KV cache": ({}, ["--kv-unified"]),
        "micro-batch 2048": ({}, ["-ub", "2048"]),  # prefill in larger steps (default 512)
        # sampling in the model's graph on the GPU instead of each slot's on the CPU over the whole
        # vocabulary (llama-server's -bs, experimental; 152,064 entries here)
        "backend sampling": ({}, ["--backend-sampling"]),
        # llama-server keeps finished prompts' KV in host RAM for reuse (--cache-ram, default 8192
        # MiB): without it, the benchmark's peak RSS is the server's own
        "no RAM prompt cache": ({}, ["--cache-ram", "0"]),
        # the same at llama.cpp's default, for a recipe that turns it off (the GPU serving recipe:
        # its 128 slots saved idle slots' states back to back at 2048/256, H100 2026-12-06); the
        # later --cache-ram wins
        "llama.cpp's RAM prompt cache": ({}, ["--cache-ram", "8192"]),
    },
}  # fmt: skip


def setting_rows(
    project: Project,
    target: str,
    manifest: dict[str, Any],
    engine: str,
    progress: Callable[[dict[str, Any]], None] | None = None,
    only: list[str] | None = None,
) -> dict[str, Any]:
    """Every level of the first workload through `engine`'s deploy command as it is, then with each
    of that engine's SERVE_SETTINGS, then as it is again: output tokens/s, ITL p50 and the share of
    the bandwidth bound at 1 (the manifest's), and each level's ratio to the command as it is (a
    setting that helps one stream may cost a full batch: Marlin against Machete). `progress` gets
    the rows so far after each setting, as `status: partial` (a lease may end mid-sweep). `only`:
    those settings alone and no second run as recorded (a short lease; the build's own serving
    benchmark of the same command, in the same run, is then the spread's other side)."""
    ours = (manifest.get("serving") or {}).get(engine) or {}
    if ours.get("status") != "passed":
        return not_benchmarked(ours)
    bound = (ours.get("decode_bound") or {}).get("bound_tokens_per_s")
    spec = project.loaded.recipe.serving_benchmark.model_copy(update={"more_workloads": []})
    ctx = project.context()
    target_spec = project.loaded.recipe.targets[target]
    artifact = project.layout.target_dir(target)
    tokenizer = tokenizer_dir(ctx, artifact)
    serve = ctx.serve(target)
    rows: dict[str, Any] = {}
    # the command as recorded again last: the spread between two servers of one command, and a
    # check that the first server is not favoured by its place (run3: 0.992 at 1, 0.977 at 128)
    chosen = SERVE_SETTINGS.get(engine, {})
    if only is None:
        tried = {"as recorded": ({}, []), **chosen, "as recorded, again": ({}, [])}
    else:
        tried = {"as recorded": ({}, []), **{name: chosen[name] for name in only if name in chosen}}
    serve_argv = (
        target_spec.serve_argv if engine == manifest["engine"] else target_spec.other_serve_argvs()[engine]
    )
    stem = _log_stem(target, engine, manifest)

    def result(status: str) -> dict[str, Any]:
        recorded = rows.get("as recorded") or {}
        for row in rows.values():
            row["ratio"] = _ratio(row, recorded)
            for key, level in (row.get("levels") or {}).items():
                base = (recorded.get("levels") or {}).get(key) or {}
                level["ratio"] = _ratio(level, base)
                # a level a cap cut on either server: what each streamed inside the cap (2026-12-08:
                # mixed chunk at 128 streams finished 335 of 512 against 384, streamed 0.837x)
                level["streamed_ratio"] = _streamed_ratio(level, base)
        reason = "the sweep had not finished when these rows were written" if status == "partial" else None
        return {"status": status, "reason": reason, "workload": spec.workload(), "bound_tokens_per_s": bound,
                "settings": rows}  # fmt: skip

    for name, (env, extra) in tried.items():
        if progress and rows:
            progress(result("partial"))
        port = free_port()
        argv = [*local_argv(serve_argv, serve, port, partial(ctx.program, ENGINES[engine].env)), *extra]
        log = project.layout.logs_dir / f"{stem}-setting-{re.sub(r'[^a-z0-9]+', '-', name.lower())}.log"
        overridden = sorted(k for k, v in env.items() if os.environ.get(k, v) != v)
        if overridden:  # the load generator lets the host's environment win over a server's
            rows[name] = {"status": "skipped", "reason": f"this host's environment sets {overridden}",
                          "env": env, "args": extra}  # fmt: skip
            continue
        request = load_request(
            engine, argv, serve.tp_size, artifact, tokenizer, spec, log.with_suffix(".server.log"), port
        )
        request["server_env"] = {**request["server_env"], **env}
        try:
            got = run_step(ENV_GUIDELLM, request, log, timeout_s=load_timeout_s(spec))
        except PipelineError as exc:  # the row records why; the sweep goes on
            rows[name] = {"status": "failed", "reason": str(exc), "env": env, "args": extra}
            continue
        by_level = {lv["concurrency"]: lv for lv in got["runs"][0]["levels"]}
        one = by_level.get(1) or {}
        tps = _rate(one)
        rows[name] = {
            "status": "passed",
            "env": env,
            "args": extra,
            # what that server logged of its kernels and mode: the setting took effect, or not
            "engine_mode": engine_mode(engine, server_log_text(Path(request["server_log"]))),
            "output_tokens_per_s": tps,
            "itl_ms_p50": one.get("itl_ms_p50"),
            "peak_rss_mib": one.get("peak_rss_mib"),
            "others_cpu_share": one.get("others_cpu_share"),
            "share_of_bound": round(tps / bound, 3) if tps and bound else None,
            "levels": {
                str(c): {k: lv.get(k) for k in ("concurrency", *LEVEL_KEYS)}
                for c, lv in sorted(by_level.items())
                if c > 1
            },
        }
    return result("passed")


def with_bounds(got: dict[str, Any], checkpoint: Path, gpu_name: str | None) -> None:
    """Each workload of a raw serving run on a safetensors checkpoint gets the decode bound the
    artifacts' rows carry (pipeline.decode_bound: its weights as stored, 16-bit KV at the context)."""
    try:
        weights = checkpoint_weights_read(checkpoint)
        kv = kv_bytes_per_context_token(json.loads((checkpoint / "config.json").read_text()))
    except (OSError, ValueError, KeyError, PipelineError) as exc:  # the measured row is kept
        print(f"no decode bound for {checkpoint}: {exc}")
        return
    for run in got.get("workloads", []):
        load, c1 = run["workload"], run["levels"].get("1") or {}
        context = load["prompt_tokens"] + load["output_tokens"]
        run["decode_bound"] = decode_bound(weights, kv, context, gpu_name, _rate(c1)).model_dump()


def serve_source(recipe: Path, json_out: Path) -> None:
    """The unquantized source served by vLLM with its defaults: the serving table's baseline."""
    project = Project.open(recipe)
    source = project.context().source.path
    project.layout.logs_dir.mkdir(parents=True, exist_ok=True)
    got = raw_serving(project, "vllm", source, project.layout.logs_dir / "source-raw-serving.log")
    with_bounds(got, source, local_gpu_name())
    rows = json.loads(json_out.read_text()) if json_out.is_file() else []
    rows.append({"target": "source (vLLM defaults)", "engine": "vllm", "device": _device(), "serving": got})
    write_results(json_out, rows)
    print(json.dumps(got, indent=1))


def raw_row(step: str, measured: dict[str, Any], steps: list[dict[str, Any]], target: str) -> dict[str, Any]:
    """One raw step beside the pipeline's same step of `target` (its manifest's build.steps)."""
    env_name, op = step.split(":")
    ours = [s for s in steps if s["op"] == op and s["env"] == env_name and s["log"] == target]
    return {
        "step": step,
        "project_s": ours[-1]["seconds"] if ours else None,
        "raw_s": measured["seconds"],
        "raw_rc": measured["rc"],
        # a raw run that failed measured nothing comparable
        "ratio": round(ours[-1]["seconds"] / measured["seconds"], 3)
        if ours and measured["rc"] == 0
        else None,
        "project_peak_rss_mib": ours[-1]["peak_rss_mib"] if ours else None,
        "raw_peak_rss_mib": measured["peak_rss_mib"],
        "project_peak_gpu_mib": ours[-1]["peak_gpu_mib"] if ours else None,
        "raw_peak_gpu_mib": measured["peak_gpu_mib"],
    }


def write_json(json_out: Path, rows: list[dict[str, Any]]) -> None:
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(rows, indent=1) + "\n")


def write_results(json_out: Path, rows: list[dict[str, Any]]) -> None:
    write_json(json_out, rows)
    json_out.with_suffix(".md").write_text(markdown(rows))


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | target | engine | version | status | ΔPPL % | KLD | serve check | build s | "
        "steps: project s / raw s (ratio) |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []

    def num(v: Any, f: str) -> str:
        return format(v, f) if isinstance(v, int | float) else "–"

    for r in rows:
        if "status" not in r:  # a serving-only row (serve-source): in the serving table below
            continue

        raw = "; ".join(
            f"{x['step']} {num(x['project_s'], '.1f')} / "
            + (
                f"{num(x['raw_s'], '.1f')} ({num(x['ratio'], '.2f')})"
                if x["raw_rc"] == 0
                else f"raw failed (rc {x['raw_rc']})"
            )
            for x in r.get("raw", [])
        )
        if r["target"] == "first-start":
            start, first = num(r.get("start_s"), ".1f"), num(r.get("first_generation_s"), ".1f")
            raw = f"start {start} s, first generation {first} s"
        kld = f"{num(r.get('kld'), '.4f')} ({r.get('kld_metric', '')})" if r.get("kld") is not None else "–"
        lines.append(
            f"| {r['model']} | {r['target']} | {r.get('engine', '–')} | {r.get('engine_version') or '–'} | "
            f"{r['status']} | {num(r.get('ppl_delta_pct'), '+.2f')} | {kld} | "
            f"{ {True: 'same ids', False: 'differs', None: '–'}[r.get('serve_check')] } | "
            f"{num(r.get('build_seconds'), '.1f')} | {raw or '–'} |"
        )
    return head + "\n".join(lines) + "\n" + serving_markdown(rows, num) + settings_markdown(rows, num)


def settings_markdown(rows: list[dict[str, Any]], num: Any) -> str:
    """Each engine setting tried (SERVE_SETTINGS) beside the command as recorded: at concurrency 1,
    then at each higher level with its ratio."""
    lines = []
    for r in rows:
        tried = r.get("settings") or {}
        if tried and tried.get("status") != "passed":
            lines.append(
                f"| {r['target']} | {r.get('engine', '–')} | {tried.get('status')}: {tried.get('reason')} |"
            )
        for name, s in (tried.get("settings") or {}).items():
            change = " ".join([*(f"{k}={v}" for k, v in s["env"].items()), *s["args"]]) or "–"
            higher = "; ".join(
                f"{lv['concurrency']}: {num(lv.get('output_tokens_per_s'), '.1f')}{_cut(lv)} "
                f"({num(lv.get('ratio'), '.3f')}{_streamed(lv.get('streamed_ratio'), '; streamed {:.3f}')})"
                for lv in (s.get("levels") or {}).values()
            )
            result = (
                f"{num(s['output_tokens_per_s'], '.1f')} | {num(s['ratio'], '.3f')} | "
                f"{num(s['itl_ms_p50'], '.2f')} | {num(s['share_of_bound'], '.0%')} | {higher or '–'}"
                if s["status"] == "passed"
                else f"{s['status']}: {s['reason']} | | | |"
            )
            lines.append(f"| {r['target']} | {r.get('engine', '–')} | {name} | `{change}` | {result} |")
    if not lines:
        return ""
    head = (
        "\n| target | engine | setting | change | tok/s at 1 | ratio to as recorded | ITL p50 ms | "
        "share of bound | higher levels: tok/s (ratio) |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    return head + "\n".join(lines) + "\n"


def serving_markdown(rows: list[dict[str, Any]], num: Any) -> str:
    """Each serving row per workload and concurrency level: through the project's serve command
    beside the engine called with its defaults (tokens/s, ratio), TTFT and ITL p50/p99, peak GPU
    memory (device-wide), share of the bandwidth bound at 1; then each artifact's memory setting
    and the KV cache its server allocated. A serve-source row has the raw side only."""
    lines, memory = [], []
    for r in rows:
        serving = r.get("serving")
        if not serving:
            continue
        if serving.get("status") != "passed" or "workloads" not in serving:
            why = f"{serving.get('status')}: {serving.get('reason')}"
            lines.append(f"| {r['target']} | {r.get('engine', '–')} | {why} |")
            continue
        kv = serving.get("kv_cache") or {}
        if serving.get("memory_setting") or kv:
            setting = ", ".join(f"{k} {v}" for k, v in (serving.get("memory_setting") or {}).items()) or "–"
            cache = (
                f"{kv['tokens']:,} tokens" + (f", {kv['mib']:,.0f} MiB" if kv.get("mib") else "")
                if kv
                else "–"
            )
            memory.append(f"| {r['target']} | {r.get('engine', '–')} | {setting} | {cache} |")
        for run in serving["workloads"]:
            shape = workload_shape(run["workload"])
            if run.get("reason"):
                lines.append(f"| {r['target']} | {r.get('engine', '–')} | {shape} | {run['reason']} |")
            bound = run.get("decode_bound") or {}
            for c, level in sorted(run["levels"].items(), key=lambda kv: int(kv[0])):
                ours, raw = (level.get("project"), level.get("raw")) if "raw" in level else (None, level)
                shown = ours or raw
                share = num(bound.get("share_c1"), ".0%") if c == "1" and bound else "–"
                tps, raw_tps = (ours or {}).get("output_tokens_per_s"), raw.get("output_tokens_per_s")
                lines.append(
                    f"| {r['target']} | {r.get('engine', '–')} | {shape} | {c} | "
                    f"{num(tps, '.1f')}{_cut(ours)} | {num(raw_tps, '.1f')}{_cut(raw)} | "
                    f"{num(level.get('ratio'), '.3f')}{_streamed(level.get('streamed_ratio'))} | "
                    f"{num(shown.get('ttft_ms_p50'), '.0f')} / {num(shown.get('ttft_ms_p99'), '.0f')} | "
                    f"{num(shown.get('itl_ms_p50'), '.2f')} / {num(shown.get('itl_ms_p99'), '.2f')} | "
                    f"{num(shown.get('peak_gpu_mib'), ',.0f')} | {share} |"
                )
    if not lines:
        return ""
    head = (
        "\n| target | engine | prompt/output tokens | concurrency | project tok/s | raw tok/s | ratio | "
        "TTFT p50 / p99 ms | ITL p50 / p99 ms | peak GPU MiB | share of bound |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    table = head + "\n".join(lines) + "\n"
    if memory:
        table += (
            "\n| target | engine | memory setting | KV cache at start |\n|---|---|---|---|\n"
            + "\n".join(memory)
            + "\n"
        )
    return table


def _streamed(ratio: float | None, form: str = " (streamed {:.3f})") -> str:
    """A cut level's ratio of what each side streamed inside the cap (its finished-only ratio is
    none), in `form` (`; streamed {:.3f}` inside a ratio's parentheses)."""
    return form.format(ratio) if ratio is not None else ""


def _cut(level: dict[str, Any] | None) -> str:
    """A mark for a level its time cap cut: unfinished requests are not counted, the window is."""
    if not level or not level.get("incomplete"):
        return ""
    finished = (level.get("completed") or 0) + (level.get("errored") or 0)
    streamed = level.get("streamed_tokens_per_s")  # none before 2026-12-07
    more = f", {streamed:.1f} streamed" if isinstance(streamed, int | float) else ""
    return f" (cut: {finished} of {level.get('planned') or '?'} finished{more})"


def _kernels(logs: Path, target: str, engine: str) -> list[str]:
    """The linear kernels `engine` named while validating `target` (its sections of the target's
    build log, then its serve check's server log), by its kernel_log line in ENGINES: vLLM says
    "Using MacheteLinearKernel for CompressedTensorsWNA16"; SGLang's server "Using awq_marlin
    kernel" (its offline engine logs nothing, nor does it name the kernel of a compressed-tensors
    checkpoint); llama.cpp names none."""
    pattern = ENGINES[engine].kernel_log
    if pattern is None:
        return []
    found: dict[str, None] = {}
    log, server_log = logs / f"{target}.log", logs / f"{target}-{engine}-server.log"
    sections = log.read_text(errors="replace").split("\n=== ")[1:] if log.is_file() else []
    texts = [s for s in sections if s.startswith(f"pipeline.workers.{engine} op=validate")]
    texts.append(server_log_text(server_log))  # "" where that server wrote no log
    for text in texts:
        for m in re.finditer(pattern, text):
            found[" for ".join(g for g in m.groups() if g)] = None
    return list(found)[:8]


def _device() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return out.splitlines()[0] if out else platform.processor()
    except (OSError, subprocess.SubprocessError):
        return f"cpu ({platform.machine()})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-checkpoint")
    mk.add_argument("out", type=Path)
    mk.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    mk.add_argument("--shape", choices=("qwen2-7b", "qwen2.5-32b", "llama2-70b"), default="qwen2-7b")
    mk.add_argument("--tokenizer", type=Path, required=True)
    wm = sub.add_parser("warm")
    wm.add_argument("model_dir", type=Path)
    wm.add_argument("--model", required=True)
    wm.add_argument("--json", type=Path, required=True)
    wm.add_argument("--attention-backend", default="triton")
    rn = sub.add_parser("run")
    rn.add_argument("recipe", type=Path)
    rn.add_argument("--targets", required=True)
    rn.add_argument("--model", required=True)
    rn.add_argument("--json", type=Path, required=True)
    rn.add_argument(
        "--raw-steps",
        default="convert,quantize,checkpoint,validate",
        help="pipeline step ops to repeat with the tool alone; serve and settings (serve:ENGINE: that "
        "engine's only) run in the order given; none: no raw side (a short lease)",
    )
    rn.add_argument(
        "--settings",
        help="the raw step settings tries these of SERVE_SETTINGS alone (comma-separated names), "
        "without its second run as recorded",
    )
    ss = sub.add_parser("serve-source")
    ss.add_argument("recipe", type=Path)
    ss.add_argument("--json", type=Path, required=True)
    cl = sub.add_parser("close", help="a run the lease ended: project sides from collected manifests")
    cl.add_argument("json", type=Path)
    cl.add_argument("--manifests", type=Path, nargs="+", required=True)
    cl.add_argument("--reason", required=True, help="why the raw side was not run")
    args = parser.parse_args()
    if args.cmd == "close":
        close_rows(args.json, args.manifests, args.reason)
        print(markdown(json.loads(args.json.read_text())))
    elif args.cmd == "serve-source":
        serve_source(args.recipe, args.json)
    elif args.cmd == "make-checkpoint":
        make_checkpoint(args.out, args.arch, args.tokenizer, args.shape)
    elif args.cmd == "warm":
        warm(args.model_dir, args.model, args.json, args.attention_backend)
    else:
        targets = [t for t in args.targets.split(",") if t]
        raw_ops = [op for op in args.raw_steps.split(",") if op and op != "none"]
        settings = [name for name in args.settings.split(",") if name] if args.settings else None
        why = raw_steps_error(raw_ops) or settings_error(settings)
        if why:
            parser.error(why)
        run(args.recipe, targets, args.model, args.json, raw_ops, settings)
    print(f"finished {datetime.now(UTC).isoformat(timespec='seconds')}")


if __name__ == "__main__":
    main()
