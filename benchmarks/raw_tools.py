"""Each tool called directly, as its own documentation shows, with the settings of one pipeline
step: the `raw` side of benchmarks/bench_gpu.py. Run in that tool's environment:

    python benchmarks/raw_tools.py TOOL REQUEST.json

TOOL: llmcompressor (AWQ/GPTQ oneshot + save), gptqmodel (GPTQModel load + quantize + save),
modelopt (mtq.quantize + export_hf_checkpoint),
vllm (LLM + prompt logprobs over the evaluation windows + greedy smoke generations),
convert (llama.cpp's convert_hf_to_gguf.py), quantize (llama_model_quantize). REQUEST is the
request the pipeline's worker got for that step, so the settings are the same. first-start: an
engine's first start and generation on a fresh host (bench_gpu.py warm).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# The pipeline's own (stdlib-only) text selection, so the raw tool sees the same tokens
from pipeline.workers.calibration import calibration_chunks, read_text
from pipeline.workers.gptqmodel import activation_order
from pipeline.workers.scoring import windows


def _chunks(tok: Any, req: dict[str, Any]) -> list[list[int]]:
    ids = tok(read_text(req["text_path"]), add_special_tokens=False)["input_ids"]
    return calibration_chunks(ids, req["samples"], req["seq_len"], req["seed"])


def llmcompressor(req: dict[str, Any]) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier  # 0.14's home (the old one is a shim)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(req["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(req["model_dir"], dtype=getattr(torch, req["dtype"]))
    chunks = _chunks(tok, req)
    ds = Dataset.from_dict({"input_ids": chunks, "attention_mask": [[1] * len(c) for c in chunks]})
    scheme = {
        "targets": ["Linear"],
        "weights": {
            "num_bits": req["bits"],
            "type": "int",
            "strategy": "group",
            "group_size": req["group_size"],
            "symmetric": req["symmetric"],
            "dynamic": False,
            **({"actorder": req["act_order"]} if req.get("act_order") else {}),
        },
    }
    if req["method"] == "awq":
        recipe: Any = [
            AWQModifier(n_grid=req["n_grid"], duo_scaling=True),
            QuantizationModifier(ignore=req["ignore"], config_groups={"group_0": scheme}),
        ]
    else:
        recipe = GPTQModifier(
            ignore=req["ignore"], config_groups={"group_0": scheme}, dampening_frac=req["dampening_frac"]
        )
    oneshot(
        model=model,
        dataset=ds,
        recipe=recipe,
        max_seq_length=req["seq_len"],
        num_calibration_samples=len(chunks),
        shuffle_calibration_samples=False,
    )
    model.save_pretrained(req["out_dir"], save_compressed=True)
    tok.save_pretrained(req["out_dir"])


def gptqmodel(req: dict[str, Any]) -> None:
    """GPTQModel's README way: load with a quantize config, quantize a list of tokenized rows, save."""
    import torch
    from gptqmodel import BACKEND, AWQConfig, GPTQConfig, GPTQModel
    from gptqmodel.quantization import FORMAT
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(req["model_dir"])
    rows = [{"input_ids": c, "attention_mask": [1] * len(c)} for c in _chunks(tok, req)]
    common = {"bits": req["bits"], "group_size": req["group_size"], "sym": req["symmetric"]}
    if req["method"] == "awq":
        config: Any = AWQConfig(**common, format=FORMAT.GEMM)
        backend = BACKEND.AWQ_TORCH
    else:
        config = GPTQConfig(
            **common,
            **activation_order(req.get("act_order"), req["group_size"]),  # the worker's mapping
            damp_percent=req["dampening_frac"],
            true_sequential=True,
            format=FORMAT.GPTQ,
        )
        backend = BACKEND.TORCH
    gpu = torch.cuda.is_available()
    model = GPTQModel.load(
        req["model_dir"], config, device="cuda" if gpu else "cpu", dtype=getattr(torch, req["dtype"])
    )
    model.quantize(rows, batch_size=1, backend=backend)
    model.save(req["out_dir"])
    tok.save_pretrained(req["out_dir"])


def modelopt(req: dict[str, Any]) -> None:
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(req["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(req["model_dir"], dtype=getattr(torch, req["dtype"])).cuda()
    batches = [torch.tensor([c], device="cuda") for c in _chunks(tok, req)]

    def forward_loop(m: Any) -> None:
        with torch.no_grad():
            for b in batches:
                m(b)

    cfg = {"fp8": mtq.FP8_DEFAULT_CFG, "int4_awq": mtq.INT4_AWQ_CFG}[req["quant"]]
    model = mtq.quantize(model, cfg, forward_loop)
    with torch.inference_mode():
        export_hf_checkpoint(model, dtype=getattr(torch, req["dtype"]), export_dir=req["out_dir"])
    tok.save_pretrained(req["out_dir"])


def vllm(req: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ref = req["reference"]
    ctx, ids = ref["ctx"], ref["eval_ids"]
    llm = LLM(
        model=req["model_dir"],
        dtype=req["dtype"],
        enforce_eager=True,
        max_logprobs=64,
        seed=0,
        max_model_len=max(ctx, max(len(g["prompt_ids"]) for g in ref["generations"]) + req["max_new_tokens"])
        + 8,
        gpu_memory_utilization=req["gpu_memory_utilization"],
    )
    llm.generate(
        [TokensPrompt(prompt_token_ids=w) for _, w in windows(ids, ctx)],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=64),
        use_tqdm=False,
    )
    greedy = SamplingParams(max_tokens=req["max_new_tokens"], temperature=0.0)
    for g in ref["generations"]:
        llm.generate([TokensPrompt(prompt_token_ids=g["prompt_ids"])], greedy, use_tqdm=False)


def convert(req: dict[str, Any]) -> None:
    converter = Path(req["llama_cpp_dir"]) / "convert_hf_to_gguf.py"
    cmd = [
        sys.executable,
        str(converter),
        req["model_dir"],
        "--outfile",
        req["out_path"],
        "--outtype",
        req["outtype"],
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def quantize(req: dict[str, Any]) -> None:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, req["ftype"])
    if llama_cpp.llama_model_quantize(
        req["in_path"].encode(), req["out_path"].encode(), ctypes.byref(params)
    ):
        raise SystemExit("llama_model_quantize failed")


def first_start(req: dict[str, Any]) -> None:
    """A fresh host's first start of an engine (`engine`: vllm or sglang) and its first greedy
    generation, as a deploy job meets them: JIT/autotune caches (FlashInfer, Triton, torch.compile)
    are filled here and reused by every later start on the host. Seconds go to `result_path`."""
    import time

    t0 = time.perf_counter()
    if req["engine"] == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=req["model_dir"], dtype=req["dtype"], max_model_len=1024, enforce_eager=True)
        started = time.perf_counter()
        llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0.0))
    else:
        import sglang

        engine = sglang.Engine(
            model_path=req["model_dir"],
            dtype=req["dtype"],
            attention_backend=req["attention_backend"],
            disable_cuda_graph=True,
            mem_fraction_static=0.5,
        )
        started = time.perf_counter()
        engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0.0})
        engine.shutdown()
    done = time.perf_counter()
    result = {"start_s": round(started - t0, 1), "first_generation_s": round(done - started, 1)}
    Path(req["result_path"]).write_text(json.dumps(result))


TOOLS = {
    "first-start": first_start,
    "llmcompressor": llmcompressor,
    "gptqmodel": gptqmodel,
    "modelopt": modelopt,
    "vllm": vllm,
    "convert": convert,
    "quantize": quantize,
}

if __name__ == "__main__":
    TOOLS[sys.argv[1]](json.loads(Path(sys.argv[2]).read_text()))
