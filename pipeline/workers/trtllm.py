"""Worker for the `trtllm` environment: TensorRT-LLM 1.2 (`trtllm-build`, its runtime).

Runs only as `python -m pipeline.workers.trtllm REQUEST RESULT` (see pipeline.environments), with the
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

from pipeline.workers.protocol import installed_versions, worker_main
from pipeline.workers.scoring import WindowScorer, generation_record, generation_scores, windows


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
    scorer = WindowScorer(np.load(Path(req["reference_dir"]) / "logits.npy", mmap_mode="r"), ref)
    t1 = time.perf_counter()
    for start, window in windows(ref["eval_ids"], ctx):
        out = runner.generate(
            [torch.tensor(window, dtype=torch.int32)],
            max_new_tokens=1,
            end_id=req["eos_token_id"],
            pad_id=req["eos_token_id"],
            top_k=1,
            return_dict=True,
        )
        torch.cuda.synchronize()
        scorer.add_logits(start, out["context_logits"][0].float().cpu().numpy(), window[1:])
    eval_s = time.perf_counter() - t1

    records, gen_s = [], 0.0
    for g in ref["generations"]:  # one at a time, as every engine's tokens_per_s is measured
        t2 = time.perf_counter()
        out = runner.generate(
            [torch.tensor(g["prompt_ids"], dtype=torch.int32)],
            max_new_tokens=req["max_new_tokens"],
            end_id=req["eos_token_id"],
            pad_id=req["eos_token_id"],
            top_k=1,
            return_dict=True,
            output_sequence_lengths=True,
        )
        torch.cuda.synchronize()
        gen_s += time.perf_counter() - t2
        length = int(out["sequence_lengths"][0][0])
        ids = [int(t) for t in out["output_ids"][0][0][len(g["prompt_ids"]) : length]]
        eos = bool(ids) and ids[-1] == req["eos_token_id"]
        records.append(generation_record(g, ids, tok.decode(ids, skip_special_tokens=True), eos))
    return {
        **scorer.result(),
        **generation_scores(records, gen_s),
        "prompt_tokens_per_s": len(ref["eval_ids"]) / eval_s if eval_s else None,
        "load_s": load_s,
        "toolchain": _versions(),
    }


if __name__ == "__main__":
    worker_main({"toolchain": op_toolchain, "build": op_build, "validate": op_validate})
