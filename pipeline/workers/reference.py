"""Worker for the `transformers` environment: the unquantized reference, imatrix, materialising.

Runs only as `python -m pipeline.workers.reference REQUEST RESULT` (see pipeline.environments);
torch and transformers are imported inside the ops.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.workers.calibration import bos_windows, calibration_chunks, document_ids, read_text
from pipeline.workers.protocol import installed_versions, worker_main
from pipeline.workers.scoring import scored_from

EOT_TOKEN = "<|im_end|>"  # ChatML end of turn (SmolLM2, Qwen2)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
MEMORY_FRACTION = 0.8  # of the free memory a placement may plan to use
HEADROOM_BYTES = 2 << 30  # activations, one window's logits (float64 log-softmax), allocator slack


def _versions() -> dict[str, str]:
    return installed_versions("transformers", "torch")


def count_parameters(model_dir: str | Path) -> int:
    """Parameters in a checkpoint's safetensors files, read from their headers (no tensor data)."""
    total = 0
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def shard_caps(weights: int, gpus_free: list[int]) -> list[int] | None:
    """Per-GPU caps (bytes) for `weights` spread over every GPU, whole layers each (accelerate's
    device_map): MEMORY_FRACTION of each GPU's free memory less HEADROOM_BYTES, so each GPU keeps
    its own headroom (the first also holds the inputs and the logits); None when there are fewer
    than two GPUs, one has no room left or together they cannot hold `weights`."""
    caps = [int(MEMORY_FRACTION * f) - HEADROOM_BYTES for f in gpus_free]
    return caps if len(caps) > 1 and min(caps) > 0 and sum(caps) >= weights else None


def choose_placement(n_params: int, gpus_free: list[int], host_free: int) -> dict[str, Any]:
    """Where the reference runs and in what precision, the first that fits: float32 (the most
    exact) on the first GPU, float32 sharded over every GPU (`gpus`: their count, `max_memory_gib`:
    shard_caps), bfloat16 the same two ways, then float32 and bfloat16 on the CPU; on one device the
    weights plus headroom must fit in MEMORY_FRACTION of its free memory. `gpus_free`: each GPU's
    free bytes ([] without one). Raises MemoryError naming the sizes."""
    gib = 2**30
    options: list[tuple[str, str, list[int]]] = []  # (device, dtype, free bytes per device)
    for dtype in DTYPE_BYTES:
        options += [("cuda", dtype, gpus_free[:1])] if gpus_free else []
        options += [("cuda", dtype, gpus_free)] if len(gpus_free) > 1 else []
    options += [("cpu", dtype, [host_free]) for dtype in DTYPE_BYTES]
    for device, dtype, free in options:
        weights = n_params * DTYPE_BYTES[dtype]
        caps = shard_caps(weights, free) if len(free) > 1 else None
        if caps is None and (len(free) > 1 or weights + HEADROOM_BYTES > MEMORY_FRACTION * free[0]):
            continue
        place = {
            "device": device,
            "dtype": dtype,
            "params": n_params,
            "need_gib": round((weights + HEADROOM_BYTES * len(free)) / gib, 2),
            "free_gib": round(sum(free) / gib, 2),
        }
        if caps is not None:
            place["gpus"] = len(free)
            place["max_memory_gib"] = [round(c / gib, 2) for c in caps]
        return place
    raise MemoryError(
        f"the reference model has {n_params / 1e9:.2f}B parameters: {n_params * 2 / gib:.1f} GiB in "
        f"bfloat16 plus {HEADROOM_BYTES / gib:.0f} GiB headroom exceeds {MEMORY_FRACTION:.0%} of the free "
        f"memory (host {host_free / gib:.1f} GiB"
        + (f", GPUs {' + '.join(f'{f / gib:.1f}' for f in gpus_free)} GiB)" if gpus_free else ", no GPU)")
    )


def gpu_load_caps(weights: int, gpus_free: list[int]) -> dict[int, int] | None:
    """How a quantizer loads `weights` bytes on the GPUs: None where the first GPU holds them with
    headroom (or there is no GPU: the caller's own placement), else accelerate's `max_memory` for a
    device_map "auto" over every GPU (shard_caps; ModelOpt's own examples load large models that
    way). Raises MemoryError naming the sizes where even all of them cannot."""
    if not gpus_free or weights + HEADROOM_BYTES <= MEMORY_FRACTION * gpus_free[0]:
        return None
    caps = shard_caps(weights, gpus_free)
    if caps is None:
        gib = 2**30
        raise MemoryError(
            f"{weights / gib:.1f} GiB of weights fit neither the first GPU nor all {len(gpus_free)} together "
            f"(free: {' + '.join(f'{f / gib:.1f}' for f in gpus_free)} GiB, {MEMORY_FRACTION:.0%} usable, "
            f"{HEADROOM_BYTES / gib:.0f} GiB headroom each)"
        )
    return dict(enumerate(caps))


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def placement_for(model_dir: str) -> dict[str, Any]:
    import torch

    gpus = range(torch.cuda.device_count()) if torch.cuda.is_available() else range(0)
    gpus_free = [torch.cuda.mem_get_info(i)[0] for i in gpus]
    return choose_placement(count_parameters(model_dir), gpus_free, host_available_bytes())


def _load(model_dir: str, trust_remote_code: bool, place: dict[str, Any]) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    sharded = {}
    if place.get("gpus", 1) > 1:  # whole layers per GPU; inputs go to the first (dispatch hooks move them)
        sharded = {"max_memory": {i: int(g * 2**30) for i, g in enumerate(place["max_memory_gib"])}}
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=getattr(torch, place["dtype"]),
        # loaded straight onto it, never a float32 copy in host memory
        device_map="auto" if sharded else place["device"],
        trust_remote_code=trust_remote_code,
        **sharded,
    )
    model.eval()
    return tok, model


def prompt_ids(tok: Any, prompt: str, chat: bool) -> list[int]:
    """Token ids of a smoke prompt: chat-formatted when the tokenizer has a template."""
    if chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tok(prompt)["input_ids"]]


def op_reference(req: dict[str, Any]) -> dict[str, Any]:
    """Reference numbers on the source checkpoint: eval logits (saved), PPL, greedy generations."""
    import numpy as np
    import torch

    t0 = time.perf_counter()
    place = placement_for(req["model_dir"])
    tok, model = _load(req["model_dir"], req["trust_remote_code"], place)
    load_s = time.perf_counter() - t0
    device = place["device"]
    # llama-perplexity's framing: the document's ids (BOS first if the tokenizer adds one), cut
    # into windows of ctx each starting with BOS, scored from ctx/2 on (pipeline.workers.scoring)
    ids, bos = document_ids(tok, read_text(req["eval_text_path"]))
    ctx, want = req["ctx"], req["eval_tokens"]
    n_chunks = min(len(ids), want) // ctx
    if n_chunks == 0:
        raise ValueError(f"evaluation text has {len(ids)} tokens, fewer than one ctx of {ctx}")
    eval_ids = [t for w in bos_windows(ids[: n_chunks * ctx], ctx, bos) for t in w]
    first = scored_from(ctx)
    out = Path(req["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    nll, n_pred, all_logits = 0.0, 0, []
    t1 = time.perf_counter()
    with torch.inference_mode():
        for c in range(n_chunks):
            chunk = torch.tensor([eval_ids[c * ctx : (c + 1) * ctx]], device=device)
            logits = model(chunk).logits[0].float()
            logp = torch.log_softmax(logits.double(), dim=-1)
            nll -= logp[first:-1].gather(1, chunk[0, first + 1 :, None]).sum().item()
            n_pred += ctx - 1 - first
            all_logits.append(logits.cpu().numpy())
    eval_s = time.perf_counter() - t1
    np.save(out / "logits.npy", np.concatenate(all_logits).astype(np.float32))
    # this run's facts go to the step log, not the result: the reference directory is a DVC out,
    # the same bytes for the same inputs (a rerun would otherwise move every build stage after it)
    device_name = _device_name(device)
    caps = f", at most {place['max_memory_gib']} GiB a GPU" if "max_memory_gib" in place else ""
    print(
        f"reference on {device_name} in {place['dtype']} ({place['free_gib']} GiB free{caps}, "
        f"{place['need_gib']} GiB needed): loaded in {load_s:.1f} s, {len(eval_ids)} tokens scored at "
        f"{len(eval_ids) / eval_s:.0f} tokens/s",
        file=sys.stderr,
        flush=True,
    )

    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    generations = []
    with torch.inference_mode():
        for prompt in req["prompts"]:
            p_ids = prompt_ids(tok, prompt, req["chat"])
            gen = model.generate(
                torch.tensor([p_ids], device=device),
                attention_mask=torch.ones(1, len(p_ids), dtype=torch.long, device=device),
                do_sample=False,
                max_new_tokens=req["max_new_tokens"],
                eos_token_id=eos_ids or None,
                pad_token_id=eos_ids[0] if eos_ids else None,
            )
            new = [int(t) for t in gen[0, len(p_ids) :]]
            generations.append(
                {
                    "prompt": prompt,
                    "prompt_ids": p_ids,
                    "output_ids": new,
                    "text": tok.decode(new, skip_special_tokens=True),
                    "stopped_at_eos": bool(new) and new[-1] in eos_ids,
                }
            )
    return {
        "eval_ids": eval_ids,
        "ctx": ctx,
        "bos_token_id": bos,  # null: the tokenizer adds none, and no window starts with one
        "scored_from": first,
        "vocab": int(all_logits[0].shape[-1]),
        "ppl": float(np.exp(nll / n_pred)),
        "eos_token_ids": eos_ids,
        "generations": generations,
        "placement": recorded_placement(place, device_name),
        "toolchain": _versions(),
    }


def recorded_placement(place: dict[str, Any], device_name: str) -> dict[str, Any]:
    """The placement as reference.json records it: where and how the reference ran, without what
    the host's free memory decided (the free GiB and a sharded load's per-GPU caps: the step log's),
    so the same inputs give the same bytes on any load of the same GPUs."""
    recorded = {k: v for k, v in place.items() if k not in ("free_gib", "max_memory_gib")}
    return {**recorded, "device_name": device_name}


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def op_imatrix(req: dict[str, Any]) -> dict[str, Any]:
    """Importance matrix for llama.cpp: mean of squared inputs per column of every Linear layer.

    Tensors are named as in the GGUF (gguf-py's own HF->GGUF name map for the architecture), so
    llama_model_quantize() can use them; the result is an .npz of name -> float32 vector.
    """
    import gguf
    import numpy as np
    import torch

    place = placement_for(req["model_dir"])
    tok, model = _load(req["model_dir"], req["trust_remote_code"], place)
    ids, bos = document_ids(tok, read_text(req["text_path"]))
    chunks = calibration_chunks(ids, req["samples"], req["seq_len"], req["seed"], bos)

    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[req["gguf_arch"]]
    n_blocks = model.config.num_hidden_layers
    name_map = gguf.get_tensor_name_map(arch, n_blocks)
    wanted: dict[str, int] = req["gguf_tensors"]  # GGUF weight name -> input size (ne[0])
    sums: dict[str, Any] = {}
    counts: dict[str, int] = {}
    hooks = []
    for module_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        gguf_name = name_map.get_name(f"{module_name}.weight", try_suffixes=(".weight",))
        if gguf_name not in wanted:
            continue
        if wanted[gguf_name] != module.in_features:
            raise ValueError(f"{gguf_name}: GGUF row size {wanted[gguf_name]} != {module.in_features}")

        def hook(_mod: Any, inputs: tuple[Any, ...], name: str = gguf_name) -> None:
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()  # on the model's device
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]

        hooks.append(module.register_forward_pre_hook(hook))
    if not hooks:
        raise ValueError(f"no Linear layer of the model maps to a GGUF tensor of arch {req['gguf_arch']}")
    with torch.inference_mode():
        for chunk in chunks:
            model(torch.tensor([chunk], device=place["device"]))
    for h in hooks:
        h.remove()
    data = {name: (sums[name] / counts[name]).float().cpu().numpy() for name in sums}
    np.savez(req["out_path"], **data)
    return {
        "placement": place,
        "tensors": len(data),
        "chunks": len(chunks),
        "tokens": sum(len(c) for c in chunks),
        "toolchain": _versions(),
    }


def op_materialise_gguf(req: dict[str, Any]) -> dict[str, Any]:
    """Dequantize a GGUF (e.g. the packaged SmolLM2) into an ordinary HF safetensors checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src, name, out = Path(req["gguf_path"]), Path(req["gguf_path"]).name, Path(req["out_dir"])
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=name, quantization_config=GgufConfig(dequantize=True)
    )
    # Older transformers derive eos=<|im_start|> from this GGUF; the end of a turn is <|im_end|>.
    eot = tok.convert_tokens_to_ids(EOT_TOKEN) if EOT_TOKEN in tok.get_vocab() else None
    if eot is not None and tok.eos_token != EOT_TOKEN:
        tok.eos_token = EOT_TOKEN
        model.config.eos_token_id = eot
        model.generation_config.eos_token_id = eot
    _restore_tokenizer(tok, src)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    written = AutoTokenizer.from_pretrained(out)
    if eot is not None and written.eos_token_id != eot:
        raise ValueError(f"written tokenizer has eos {written.eos_token!r}, expected {EOT_TOKEN}")
    return {"eos_token": written.eos_token, "eos_token_id": written.eos_token_id, "toolchain": _versions()}


def _restore_tokenizer(tok: Any, gguf_path: Path) -> None:
    """Make the rebuilt tokenizer the one the GGUF declares.

    transformers rebuilds a GGUF's BPE tokenizer with plain ByteLevel splitting; SmolLM2's own
    (llama.cpp pre-tokenizer `smollm`) also splits digits one by one: put that back so the
    reference tokenizes text as the original model and llama.cpp do. Some releases (5.17, seen on
    the GPU host) also give a byte-level (`gpt2`) BPE SentencePiece's byte fallback and `▁`
    decoders; llama.cpp's converter then writes a vocabulary whose tokenizer aborts in
    `llama_vocab::byte_to_token`. A byte-level BPE has neither: remove them."""
    import gguf
    from tokenizers import decoders, pre_tokenizers

    reader = gguf.GGUFReader(gguf_path)
    pre, model = reader.get_field("tokenizer.ggml.pre"), reader.get_field("tokenizer.ggml.model")
    backend = tok.backend_tokenizer
    if pre is not None and pre.contents() == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if model is not None and model.contents() == "gpt2" and getattr(backend.model, "byte_fallback", False):
        backend.model.byte_fallback = False
        backend.normalizer = None
        backend.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)


def op_toolchain(_req: dict[str, Any]) -> dict[str, Any]:
    return {"toolchain": _versions()}


def op_placement(req: dict[str, Any]) -> dict[str, Any]:
    """Where and in what precision a reference of `model_dir` would run now (no model loaded)."""
    return {"placement": placement_for(req["model_dir"])}


if __name__ == "__main__":
    worker_main(
        {
            "reference": op_reference,
            "imatrix": op_imatrix,
            "materialise_gguf": op_materialise_gguf,
            "toolchain": op_toolchain,
            "placement": op_placement,
        }
    )
