"""Worker for the `modelopt` environment: NVIDIA ModelOpt calibration and checkpoint export.

Runs only as `python -m pipeline.workers.modelopt REQUEST RESULT` (see pipeline.environments).
`checkpoint` calibrates (FP8, INT8 SmoothQuant, INT8 weight-only, INT4 AWQ; nothing for FP16/BF16)
on the recipe's calibration text and writes either a TensorRT-LLM checkpoint (`config.json` +
`rank<N>.safetensors`, the input of `trtllm-build`) or a unified HF checkpoint (safetensors +
`hf_quant_config.json`, loaded by `trtllm-serve`'s PyTorch backend, vLLM and SGLang).
Uses the GPU when there is one; ModelOpt's fake-quant kernels also run on CPU.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

from pipeline.workers.calibration import calibration_chunks, document_ids, read_text
from pipeline.workers.protocol import installed_versions, worker_main
from pipeline.workers.reference import count_parameters, gpu_load_caps

# recipe quant -> ModelOpt preset config (None: export unquantized)
PRESETS = {
    "fp16": None,
    "bf16": None,
    "fp8": "FP8_DEFAULT_CFG",
    "int8_sq": "INT8_SMOOTHQUANT_CFG",
    "int8_wo": "INT8_WEIGHT_ONLY_CFG",
    "int4_awq": "INT4_AWQ_CFG",
}


def _versions() -> dict[str, str]:
    return installed_versions("nvidia-modelopt", "torch", "transformers")


def op_toolchain(_req: dict[str, Any]) -> dict[str, Any]:
    import torch

    gpu = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        gpu = {"name": torch.cuda.get_device_name(0), "arch": f"sm{major}{minor}"}
    return {"toolchain": _versions(), "gpu": gpu}


def quant_config(req: dict[str, Any]) -> dict[str, Any] | None:
    """The ModelOpt config for the request: its preset, with the recipe's alpha, group size and
    KV-cache precision applied."""
    import modelopt.torch.quantization as mtq

    preset = PRESETS[req["quant"]]
    if preset is None:
        return None
    cfg = copy.deepcopy(getattr(mtq, preset))
    if req["quant"] == "int8_sq":
        cfg["algorithm"] = {"method": "smoothquant", "alpha": req["smoothquant_alpha"]}
    if req["quant"] == "int4_awq":
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer" and "block_sizes" in entry.get("cfg", {}):
                entry["cfg"]["block_sizes"][-1] = req["group_size"]
    if req.get("kv_cache_dtype") == "fp8":
        cfg["quant_cfg"] = [*cfg["quant_cfg"], *copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])]
    return cfg


def op_checkpoint(req: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(req["seed"])
    src, out = req["model_dir"], Path(req["out_dir"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # bf16 compute on CPU (fp16 matmuls are very slow there); the export dtype is the target's.
    load_dtype = getattr(torch, req["dtype"]) if device == "cuda" else torch.bfloat16
    tok = AutoTokenizer.from_pretrained(src, trust_remote_code=req["trust_remote_code"])
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    free = [torch.cuda.mem_get_info(i)[0] for i in range(gpus)]
    caps = gpu_load_caps(count_parameters(src) * load_dtype.itemsize, free)
    model = AutoModelForCausalLM.from_pretrained(
        src,
        dtype=load_dtype,
        trust_remote_code=req["trust_remote_code"],
        **({"device_map": "auto", "max_memory": caps} if caps else {}),
    )
    model = model if caps else model.to(device)  # spread: calibration inputs go to the first GPU
    model.eval()
    cfg = quant_config(req)
    calibrated: dict[str, Any] = {"samples": 0, "tokens": 0, "seconds": 0.0}
    if cfg is not None:
        chunks = _calibration(tok, req)
        batches = [torch.tensor([c], device=device) for c in chunks]

        def forward_loop(m: Any) -> None:
            with torch.no_grad():
                for batch in batches:
                    m(batch)

        import modelopt.torch.quantization as mtq

        t0 = time.perf_counter()
        model = mtq.quantize(model, cfg, forward_loop)
        calibrated = {
            "samples": len(chunks),
            "tokens": sum(len(c) for c in chunks),
            "seconds": time.perf_counter() - t0,
        }
    t0 = time.perf_counter()
    export_dtype = getattr(torch, req["dtype"])
    with torch.inference_mode():
        if req["format"] == "trtllm":
            from modelopt.torch.export import export_tensorrt_llm_checkpoint
            from modelopt.torch.export.model_utils import get_model_type

            decoder = get_model_type(model)
            if decoder is None:
                raise ValueError(f"ModelOpt cannot export {type(model).__name__} to TensorRT-LLM")
            export_tensorrt_llm_checkpoint(
                model, decoder, export_dtype, out, inference_tensor_parallel=req["tp_size"]
            )
            written = json.loads((out / "config.json").read_text())
        else:
            from modelopt.torch.export import export_hf_checkpoint

            export_hf_checkpoint(model, dtype=export_dtype, export_dir=out)
            tok.save_pretrained(out)
            qcfg = out / "hf_quant_config.json"
            written = json.loads(qcfg.read_text()) if qcfg.is_file() else {}
    return {
        "config": written,
        "calibration": calibrated,
        "export_seconds": time.perf_counter() - t0,
        "device": device if device == "cpu" else torch.cuda.get_device_name(0),
        "gpus": len({d for d in getattr(model, "hf_device_map", {}).values() if isinstance(d, int)})
        if caps
        else min(gpus, 1),
        "toolchain": _versions(),
    }


def _calibration(tok: Any, req: dict[str, Any]) -> list[list[int]]:
    text = read_text(req["text_path"])
    ids, bos = document_ids(tok, text)
    chunks = calibration_chunks(ids, req["samples"], req["seq_len"], req["seed"], bos)
    if len(chunks) < req["samples"]:
        raise ValueError(
            f"calibration set too small: {req['text_path']} gives {len(chunks)} sequences of "
            f"{req['seq_len']} tokens, the recipe asks for {req['samples']}; add text or lower "
            "calibration samples/seq_len"
        )
    return chunks


if __name__ == "__main__":
    worker_main({"toolchain": op_toolchain, "checkpoint": op_checkpoint})
