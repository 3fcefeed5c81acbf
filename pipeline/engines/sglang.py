"""Worker for the `sglang` environment (GPU build servers): score an AWQ/GPTQ checkpoint in SGLang.

Runs only as `python -m pipeline.engines.sglang REQUEST RESULT` (see pipeline.workers), against
SGLang's offline engine (`sglang.Engine`). Not exercised on the CPU machines this project is
developed on: PyPI's sglang is CUDA-only there, so the build records SGLang as `skipped`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pipeline.engines.scoring import common_prefix, kld_topk, softmax
from pipeline.workers import installed_versions, worker_main

TOP_K = 64


def op_toolchain(_req: dict[str, Any]) -> dict[str, Any]:
    return {"toolchain": installed_versions("sglang", "torch", "transformers")}


def op_validate(req: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import sglang

    ref = req["reference"]
    ctx, eval_ids = ref["ctx"], ref["eval_ids"]
    t0 = time.perf_counter()
    engine = sglang.Engine(
        model_path=req["model_dir"], quantization=req["quantization"], dtype=req["dtype"], random_seed=0
    )
    startup_s = time.perf_counter() - t0
    try:
        ref_logits = np.load(Path(req["reference_dir"]) / "logits.npy", mmap_mode="r")
        chunks = [eval_ids[c * ctx : (c + 1) * ctx] for c in range(len(eval_ids) // ctx)]
        t1 = time.perf_counter()
        outs = engine.generate(
            input_ids=chunks,
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=TOP_K,
        )
        score_s = time.perf_counter() - t1
        nll = kld = 0.0
        n_pred = 0
        for c, out in enumerate(outs):
            # input_token_logprobs: (logprob, token id, text) per prompt token, None for the first
            token_lps = out["meta_info"]["input_token_logprobs"]
            top_lps = out["meta_info"]["input_top_logprobs"]
            for i in range(1, ctx):
                nll -= token_lps[i][0]
                p = softmax(np.asarray(ref_logits[c * ctx + i - 1], dtype=np.float64))
                kld += kld_topk(p, {tid: lp for lp, tid, _ in top_lps[i]})
                n_pred += 1
        t2 = time.perf_counter()
        gens = engine.generate(
            input_ids=[g["prompt_ids"] for g in ref["generations"]],
            sampling_params={"max_new_tokens": req["max_new_tokens"], "temperature": 0.0},
        )
        gen_s = time.perf_counter() - t2
        agreements, n_tokens, generations = [], 0, []
        for g, out in zip(ref["generations"], gens, strict=True):
            ids = list(out["output_ids"])
            n_tokens += len(ids)
            prefix = common_prefix(ids, g["output_ids"])
            agreements.append(prefix / max(len(g["output_ids"]), 1))
            generations.append({"prompt": g["prompt"], "text": out["text"], "leading_tokens_agreed": prefix})
    finally:
        engine.shutdown()
    return {
        "ppl": float(np.exp(nll / n_pred)),
        "kld_mean": kld / n_pred,
        "token_agreement": float(np.mean(agreements)),
        "tokens_per_s": n_tokens / gen_s,
        "prompt_tokens_per_s": len(eval_ids) / score_s,
        "startup_s": startup_s,
        "generations": generations,
    }


if __name__ == "__main__":
    worker_main({"toolchain": op_toolchain, "validate": op_validate})
