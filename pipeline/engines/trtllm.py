"""Worker for the `trtllm` environment: TensorRT-LLM 1.2 (`trtllm-build`, its runtime).

Runs only as `python -m pipeline.engines.trtllm REQUEST RESULT` (see pipeline.workers), with the
interpreter of NVIDIA's TensorRT-LLM 1.2 container or a build server's venv: its wheel is not on
PyPI and it needs a CUDA GPU, so this module has never run on the CPU machines this project is
developed on. It is written against the 1.2 API (tensorrt_llm.commands.build, ModelRunnerCpp).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.engines.scoring import common_prefix, window_scores
from pipeline.workers import installed_versions, worker_main


def _versions() -> dict[str, str]:
    found = installed_versions("tensorrt_llm", "tensorrt", "nvidia-modelopt", "torch", "transformers")
    if "tensorrt" not in found:  # the container ships TensorRT's python bindings under other names
        try:
            import tensorrt

            found["tensorrt"] = tensorrt.__version__
        except ImportError:
            pass
    return found


def op_toolchain(_req: dict[str, Any]) -> dict[str, Any]:
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            gpu = {
                "name": torch.cuda.get_device_name(0),
                "arch": f"sm{major}{minor}",
                "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                "cuda": torch.version.cuda,
            }
    except ImportError:
        pass
    return {"toolchain": _versions(), "gpu": gpu}


def op_build(req: dict[str, Any]) -> dict[str, Any]:
    """Run the planned `trtllm-build` command (argv[0] is resolved in this environment)."""
    argv = list(req["argv"])
    exe = shutil.which(argv[0], path=os.path.dirname(sys.executable)) or shutil.which(argv[0])
    if exe is None:
        raise RuntimeError(f"{argv[0]} not found beside {sys.executable} or on PATH")
    t0 = time.perf_counter()
    proc = subprocess.run([exe, *argv[1:]], stdout=sys.stdout, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"trtllm-build failed with exit code {proc.returncode}")
    out = Path(req["output_dir"])
    engines = sorted(p.name for p in out.glob("rank*.engine"))
    if not engines or not (out / "config.json").is_file():
        raise RuntimeError(f"trtllm-build wrote no engine into {out}")
    return {"seconds": time.perf_counter() - t0, "engines": engines, "toolchain": _versions()}


def op_validate(req: dict[str, Any]) -> dict[str, Any]:
    """Score an engine against the transformers reference: PPL and KLD from context logits
    (engine built with --gather_context_logits), greedy generations, decode speed."""
    import numpy as np
    import torch
    from tensorrt_llm.runtime import ModelRunnerCpp
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(req["tokenizer_dir"])
    ref = req["reference"]
    ctx = ref["ctx"]
    t0 = time.perf_counter()
    runner = ModelRunnerCpp.from_dir(req["engine_dir"], rank=0)
    load_s = time.perf_counter() - t0
    ref_logits = np.load(Path(req["reference_dir"]) / "logits.npy", mmap_mode="r")
    eval_ids = ref["eval_ids"]
    windows = [eval_ids[c * ctx : (c + 1) * ctx] for c in range(len(eval_ids) // ctx)]
    nll = kld = 0.0
    n_pred = same_top = 0
    t1 = time.perf_counter()
    for c, window in enumerate(windows):
        out = runner.generate(
            [torch.tensor(window, dtype=torch.int32)],
            max_new_tokens=1,
            end_id=req["eos_token_id"],
            pad_id=req["eos_token_id"],
            top_k=1,
            return_dict=True,
        )
        torch.cuda.synchronize()
        logits = out["context_logits"][0].float().cpu().numpy()
        vocab = min(logits.shape[1], ref_logits.shape[1])
        ours = logits[: ctx - 1, :vocab].astype(np.float64)
        theirs = np.array(ref_logits[c * ctx : (c + 1) * ctx - 1, :vocab], dtype=np.float64)
        w_nll, w_kld, w_top = window_scores(ours, theirs, window[1:])
        nll += w_nll
        kld += w_kld
        same_top += w_top
        n_pred += ctx - 1
    eval_s = time.perf_counter() - t1

    prompts = [g["prompt_ids"] for g in ref["generations"]]
    t2 = time.perf_counter()
    out = runner.generate(
        [torch.tensor(p, dtype=torch.int32) for p in prompts],
        max_new_tokens=req["max_new_tokens"],
        end_id=req["eos_token_id"],
        pad_id=req["eos_token_id"],
        top_k=1,
        return_dict=True,
        output_sequence_lengths=True,
    )
    torch.cuda.synchronize()
    gen_s = time.perf_counter() - t2
    generations, agreements, new_tokens = [], [], 0
    for i, g in enumerate(ref["generations"]):
        length = int(out["sequence_lengths"][i][0])
        ids = [int(t) for t in out["output_ids"][i][0][len(prompts[i]) : length]]
        new_tokens += len(ids)
        prefix = common_prefix(ids, g["output_ids"])
        agreements.append(prefix / max(len(g["output_ids"]), 1))
        generations.append(
            {
                "prompt": g["prompt"],
                "text": tok.decode(ids, skip_special_tokens=True),
                "output_ids": ids,
                "reference_text": g["text"],
                "tokens": len(ids),
                "stopped_at_eos": bool(ids) and ids[-1] == req["eos_token_id"],
                "leading_tokens_agreed": prefix,
            }
        )
    return {
        "ppl": float(np.exp(nll / n_pred)),
        "kld_mean": kld / n_pred,
        "top1_agreement": same_top / n_pred,
        "token_agreement": float(np.mean(agreements)),
        "tokens_per_s": new_tokens / gen_s if gen_s else None,
        "prompt_tokens_per_s": n_pred / eval_s if eval_s else None,
        "load_s": load_s,
        "generations": generations,
        "toolchain": _versions(),
    }


if __name__ == "__main__":
    worker_main({"toolchain": op_toolchain, "build": op_build, "validate": op_validate})
