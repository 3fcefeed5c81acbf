"""Worker for the `llmcompressor` environment: AWQ and GPTQ W4A16 with llm-compressor.

Runs only as `python -m pipeline.workers.llmcompressor REQUEST RESULT` (see pipeline.environments).
Writes a compressed-tensors (pack-quantized) checkpoint, which vLLM and SGLang both load.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pipeline.workers.calibration import calibration_chunks, document_ids, read_text
from pipeline.workers.protocol import installed_versions, worker_main


def _versions() -> dict[str, str]:
    return installed_versions("llmcompressor", "compressed-tensors", "torch", "transformers")


def op_toolchain(_req: dict[str, Any]) -> dict[str, Any]:
    return {"toolchain": _versions()}


def _allow_cpu_only_awq() -> None:
    """llm-compressor 0.14's AWQ pins every cached activation (`pin_memory()`), which raises on a
    torch build without an accelerator. Pinning only speeds up host->GPU copies, so without a GPU
    it is skipped; with one, nothing changes."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.cuda.is_available():
        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


def op_quantize(req: dict[str, Any]) -> dict[str, Any]:
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(req["seed"])
    src, out = req["model_dir"], Path(req["out_dir"])
    tok = AutoTokenizer.from_pretrained(src, trust_remote_code=req["trust_remote_code"])
    model = AutoModelForCausalLM.from_pretrained(
        src, dtype=getattr(torch, req["dtype"]), trust_remote_code=req["trust_remote_code"]
    )
    text = read_text(req["text_path"])
    if not text.strip():
        raise ValueError(f"calibration file {req['text_path']} is empty")
    ids, bos = document_ids(tok, text)
    chunks = calibration_chunks(ids, req["samples"], req["seq_len"], req["seed"], bos)
    dataset = Dataset.from_dict({"input_ids": chunks, "attention_mask": [[1] * len(c) for c in chunks]})
    weights = QuantizationArgs(
        num_bits=req["bits"],
        type="int",
        strategy="group",
        group_size=req["group_size"],
        symmetric=req["symmetric"],
        dynamic=False,
        **({"actorder": req["act_order"]} if req.get("act_order") else {}),
    )
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    if req["method"] == "awq":
        from llmcompressor.modifiers.transform.awq import AWQModifier

        _allow_cpu_only_awq()
        recipe: Any = [
            AWQModifier(n_grid=req["n_grid"], duo_scaling=True),
            QuantizationModifier(ignore=req["ignore"], config_groups=groups),
        ]
    else:
        recipe = [
            GPTQModifier(ignore=req["ignore"], config_groups=groups, dampening_frac=req["dampening_frac"])
        ]
    t0 = time.perf_counter()
    oneshot(
        model=model,
        dataset=dataset,
        recipe=recipe,
        max_seq_length=req["seq_len"],
        num_calibration_samples=len(chunks),
        shuffle_calibration_samples=False,
    )
    seconds = time.perf_counter() - t0
    bad = [
        name
        for name, t in model.state_dict().items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if bad:
        raise ValueError(f"calibration produced NaN/inf in {len(bad)} tensors (first: {bad[0]})")
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    qcfg = config.get("quantization_config") or {}
    if not qcfg:
        raise ValueError("llm-compressor wrote no quantization_config")
    orders = {(g.get("weights") or {}).get("actorder") for g in (qcfg.get("config_groups") or {}).values()}
    order = next(iter(orders)) if len(orders) == 1 else ",".join(sorted(map(str, orders))) or None
    return {
        "quantization_config": qcfg,
        "activation_order": order,  # GPTQ's actorder as written (one per config group)
        "seconds": seconds,
        "chunks": len(chunks),
        "tokens": sum(len(c) for c in chunks),
        # llm-compressor onloads each layer to the accelerator when there is one
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "toolchain": _versions(),
    }


if __name__ == "__main__":
    worker_main({"toolchain": op_toolchain, "quantize": op_quantize})
