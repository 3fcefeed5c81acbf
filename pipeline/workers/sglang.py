"""Worker for the `sglang` environment (GPU build servers): score an AWQ/GPTQ checkpoint in SGLang,
then serve it once with the manifest's `sglang.launch_server` command.

Runs only as `python -m pipeline.workers.sglang REQUEST RESULT` (see pipeline.environments), against
SGLang's offline engine (`sglang.Engine`). Never run on the CPU machines this project is developed
on (PyPI's sglang is CUDA-only; the build records SGLang as `skipped` there); its tests carry the
`gpu` marker.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pipeline.workers.protocol import installed_versions, worker_main
from pipeline.workers.scoring import WindowScorer, generation_record, generation_scores, windows
from pipeline.workers.serving import TIE_TOP, post_json, serve_check

TOP_K = 64


def op_toolchain(_req: dict[str, Any]) -> dict[str, Any]:
    return {"toolchain": installed_versions("sglang", "torch", "transformers")}


def op_validate(req: dict[str, Any]) -> dict[str, Any]:
    """Perplexity, top-K KL divergence, greedy agreement and speed in SGLang's offline engine
    (the measures of pipeline.workers.scoring)."""
    import numpy as np
    import sglang

    ref = req["reference"]
    ctx, eval_ids = ref["ctx"], ref["eval_ids"]
    import torch

    # Scoring needs the numbers, not the fastest start: no CUDA graph capture.
    settings: dict[str, Any] = {"disable_cuda_graph": True, "tp_size": req.get("tp_size", 1)}
    if req.get("attention_backend"):
        settings["attention_backend"] = req["attention_backend"]
    t0 = time.perf_counter()
    engine = sglang.Engine(
        model_path=req["model_dir"],
        quantization=req["quantization"],
        dtype=req["dtype"],
        random_seed=0,
        mem_fraction_static=req["mem_fraction_static"],
        **settings,
    )
    startup_s = time.perf_counter() - t0
    try:
        scorer = WindowScorer(np.load(Path(req["reference_dir"]) / "logits.npy", mmap_mode="r"), ref)
        chunks = windows(eval_ids, ctx)
        t1 = time.perf_counter()
        outs = engine.generate(
            input_ids=[ids for _, ids in chunks],
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=TOP_K,
        )
        score_s = time.perf_counter() - t1
        for (start, _), out in zip(chunks, outs, strict=True):
            # input_token_logprobs: (logprob, token id, text) per prompt token, None for the first
            token_lps = out["meta_info"]["input_token_logprobs"]
            top_lps = out["meta_info"]["input_top_logprobs"]
            for i in range(1, ctx):
                top = {int(tid): float(lp) for lp, tid, _ in top_lps[i]}
                scorer.add_topk(start + i - 1, float(token_lps[i][0]), top, TOP_K)
        records, gen_s, first_top = [], 0.0, []
        # one at a time, as every engine's tokens_per_s is measured
        for n, g in enumerate(ref["generations"]):
            t2 = time.perf_counter()
            out = engine.generate(
                input_ids=g["prompt_ids"],
                sampling_params={"max_new_tokens": req["max_new_tokens"], "temperature": 0.0},
                # the serve check's prompt: what the engine thought at each step (near-ties)
                **({"return_logprob": True, "top_logprobs_num": TIE_TOP} if n == 0 else {}),
            )
            gen_s += time.perf_counter() - t2
            ids = [int(t) for t in out["output_ids"]]
            records.append(generation_record(g, ids, out["text"], _finish(out) == "stop"))
            if n == 0:
                steps = out["meta_info"].get("output_top_logprobs") or []
                first_top = [{str(int(tid)): float(lp) for lp, tid, _ in step} for step in steps]
    finally:
        engine.shutdown()
    return {
        "first_generation_top_logprobs": first_top,
        **scorer.result(),
        **generation_scores(records, gen_s),
        "prompt_tokens_per_s": len(ref["eval_ids"]) / score_s,
        "startup_s": startup_s,
        "settings": settings,
        "device": torch.cuda.get_device_name(0),
        "toolchain": installed_versions("sglang", "torch", "transformers"),
    }


def _finish(out: dict[str, Any]) -> str | None:
    return (out["meta_info"].get("finish_reason") or {}).get("type")


def _ask_generate(base: str, req: dict[str, Any]) -> dict[str, Any]:
    """One greedy request to SGLang's native /generate: it takes token ids and answers with them."""
    body = {
        "input_ids": req["prompt_ids"],
        "sampling_params": {"max_new_tokens": req["max_tokens"], "temperature": 0.0},
    }
    out = post_json(f"{base}/generate", body)
    ids = [int(t) for t in out["output_ids"]]
    return {"text": out["text"], "token_ids": ids, "finish_reason": _finish(out)}


def op_serve_check(req: dict[str, Any]) -> dict[str, Any]:
    """The manifest's serve command (sglang.launch_server), once: pipeline.workers.serving."""
    return serve_check(req, "SGLang", _ask_generate)


if __name__ == "__main__":
    worker_main({"toolchain": op_toolchain, "validate": op_validate, "serve_check": op_serve_check})
