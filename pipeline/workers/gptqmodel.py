"""Worker for the `gptqmodel` environment: AWQ and GPTQ W4A16 with GPTQModel (the second backend).

Runs only as `python -m pipeline.workers.gptqmodel REQUEST RESULT` (see pipeline.environments). Takes
the llm-compressor worker's request and writes GPTQModel's own formats, which vLLM and SGLang load
by their config: GPTQ (`quant_method: gptq`, v1 zeros) and AWQ GEMM (`quant_method: awq`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.workers.calibration import calibration_chunks, document_ids, read_text
from pipeline.workers.protocol import installed_versions, worker_main

OFFLOAD_DIR = "offload"  # relative to the quantize step's scratch directory


def activation_order(act_order: str | bool | None, group_size: int) -> dict[str, bool]:
    """GPTQConfig's ordering for the recipe's `act_order`. With groups: GPTQModel's group-aware
    reordering (act_group_aware, its own default for GPTQ, so `act_order` left out gives the same),
    calibration order only and the GPTQ format unchanged; never desc_act, whose activation-ordered
    group indices (g_idx) vLLM 0.32 refuses and which CUDA vLLM 0.26 served at 0.85x the tokens/s of
    llm-compressor's GPTQ (H100, 2026-12-06). One group per channel (-1): group-aware reordering
    needs groups, and desc_act changes no format (vLLM treats it as off)."""
    if group_size > 0:
        return {"desc_act": False, "act_group_aware": True}
    return {"desc_act": bool(act_order), "act_group_aware": False}


def _versions() -> dict[str, str]:
    return installed_versions("gptqmodel", "torch", "transformers")


def op_toolchain(_req: dict[str, Any]) -> dict[str, Any]:
    return {"toolchain": _versions()}


def op_quantize(req: dict[str, Any]) -> dict[str, Any]:
    """Quantize in a scratch directory: GPTQModel writes per-layer stats to `./logs/`, which go to
    this step's log instead of the caller's working directory."""
    req = {**req, **{k: os.path.abspath(req[k]) for k in ("model_dir", "out_dir", "text_path")}}
    with tempfile.TemporaryDirectory(prefix="gptqmodel-") as scratch:
        here = os.getcwd()
        os.chdir(scratch)
        try:
            return _quantize(req)
        finally:
            for stats in sorted(Path(scratch, "logs").glob("*.log")):
                print(f"--- GPTQModel {stats.name}\n{stats.read_text(errors='replace')}")
            os.chdir(here)


def _quantize(req: dict[str, Any]) -> dict[str, Any]:
    # Set before GPTQModel is imported, here rather than at module level so that importing this
    # module (benchmarks/raw_tools.py reads activation_order) changes nothing: GPTQModel splits a
    # CPU into worker pools and refuses to start with fewer than it asks for; the packing C++
    # extension it would compile on first use is replaced by its pure-torch path.
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(os.cpu_count() or 1))
    os.environ.setdefault("GPTQMODEL_DISABLE_PACK_EXT", "1")
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.quantization import FORMAT
    from transformers import AutoTokenizer

    if [m for m in req["ignore"] if m != "lm_head"]:
        raise ValueError(f"the gptqmodel backend keeps only lm_head unquantized, not {req['ignore']}")
    torch.manual_seed(req["seed"])
    src, out = req["model_dir"], Path(req["out_dir"])
    tok = AutoTokenizer.from_pretrained(src, trust_remote_code=req["trust_remote_code"])
    text = read_text(req["text_path"])
    if not text.strip():
        raise ValueError(f"calibration file {req['text_path']} is empty")
    ids, bos = document_ids(tok, text)
    chunks = calibration_chunks(ids, req["samples"], req["seq_len"], req["seed"], bos)
    calibration = [{"input_ids": c, "attention_mask": [1] * len(c)} for c in chunks]
    gpu = torch.cuda.is_available()
    # The quantized modules GPTQModel builds in memory (it only saves them here) use its portable
    # torch kernels, CPU or GPU: AUTO would pick AWQ GEMM / Marlin on CUDA, which it JIT-compiles
    # with nvcc on first use (minutes on a fresh build server), for a model nobody runs here.
    # Disk offload into the scratch directory (the cwd) under a fixed relative name: GPTQModel
    # records the path in config.json and quantize_config.json, and its default, a fresh random
    # temp dir, made two builds of the same inputs differ in those two files.
    common = {
        "bits": req["bits"], "group_size": req["group_size"], "sym": req["symmetric"],
        "offload_to_disk_path": OFFLOAD_DIR,
    }  # fmt: skip
    if req["method"] == "awq":
        from gptqmodel import AWQConfig

        config: Any = AWQConfig(**common, format=FORMAT.GEMM)
        backend = BACKEND.AWQ_TORCH
    else:
        from gptqmodel import GPTQConfig

        config = GPTQConfig(
            **common,
            **activation_order(req.get("act_order"), req["group_size"]),
            damp_percent=req["dampening_frac"],
            true_sequential=True,
            format=FORMAT.GPTQ,
        )
        backend = BACKEND.TORCH
    model = GPTQModel.load(
        src,
        config,
        device="cuda" if gpu else "cpu",
        dtype=getattr(torch, req["dtype"]),
        trust_remote_code=req["trust_remote_code"],
    )
    t0 = time.perf_counter()
    model.quantize(calibration, batch_size=1, backend=backend)
    seconds = time.perf_counter() - t0
    model.save(str(out))
    tok.save_pretrained(out)
    # its per-layer loss log carries each layer's wall time: to this step's log, not the artifact
    quant_log = out / "quant_log.csv"
    if quant_log.is_file():
        print(f"--- GPTQModel quant_log.csv\n{quant_log.read_text(errors='replace')}")
        quant_log.unlink()
    qcfg = json.loads((out / "config.json").read_text()).get("quantization_config") or {}
    if not qcfg:
        raise ValueError("GPTQModel wrote no quantization_config")
    meta = qcfg.get("meta") or {}
    ordered = "group-aware" if meta.get("act_group_aware") else "desc_act" if qcfg.get("desc_act") else None
    return {
        "quantization_config": {k: v for k, v in qcfg.items() if k != "meta"},
        "activation_order": ordered if req["method"] == "gptq" else None,
        "seconds": seconds,
        "chunks": len(chunks),
        "tokens": sum(len(c) for c in chunks),
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "toolchain": _versions(),
    }


if __name__ == "__main__":
    worker_main({"toolchain": op_toolchain, "quantize": op_quantize})
