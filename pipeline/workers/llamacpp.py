"""Worker for the `llamacpp` environment: convert, quantize, inspect and validate GGUF files, and
serve one through the deploy command, llama.cpp's llama-server (the serve check).

Runs only as `python -m pipeline.workers.llamacpp REQUEST RESULT` (see pipeline.environments). The
converter, gguf-py, llama-imatrix, llama-perplexity and llama-server come from the llama-cpp-python
sdist of the installed runtime (placed in `<env prefix>/share/pipeline/llama.cpp` by
scripts/setup.sh), so one llama.cpp commit converts, computes the importance matrix, quantizes,
scores and serves.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.constants import GGUF_QUANTS, LLAMA_SERVER, LLAMACPP_SPLIT_MODES
from pipeline.workers.calibration import bos_windows, calibration_chunks, read_text
from pipeline.workers.protocol import installed_versions, worker_main
from pipeline.workers.scoring import (
    WindowScorer,
    common_prefix,
    generation_record,
    generation_scores,
    windows,
)
from pipeline.workers.serving import TIE_TOP, post_json, serve_check


def llama_cpp_dir() -> Path:
    """The converter directory that belongs to this environment's llama-cpp-python."""
    override = os.environ.get("PIPELINE_LLAMA_CPP_DIR")
    return Path(override) if override else Path(sys.prefix) / "share" / "pipeline" / "llama.cpp"


TOOLS = ("llama-imatrix", "llama-perplexity", LLAMA_SERVER)


def tool(name: str) -> Path:
    """One of llama.cpp's own tools, built from this runtime's sdist by scripts/setup.sh."""
    path = llama_cpp_dir() / "bin" / name
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"{path} missing: run scripts/setup.sh to build llama.cpp's tools")
    return path


def op_toolchain(_req: dict[str, Any]) -> dict[str, Any]:
    """Versions of everything in this environment that touches a GGUF."""
    import gguf
    import llama_cpp
    import numpy

    build_file = llama_cpp_dir() / "BUILD.json"
    if not build_file.is_file():
        raise FileNotFoundError(f"{build_file} missing: run scripts/setup.sh to install the converter")
    build = json.loads(build_file.read_text())
    if build["llama_cpp_python"] != llama_cpp.__version__:
        raise RuntimeError(
            f"converter is from llama-cpp-python {build['llama_cpp_python']} but the runtime is "
            f"{llama_cpp.__version__}: rerun scripts/setup.sh"
        )
    converter = llama_cpp_dir() / "convert_hf_to_gguf.py"
    found = installed_versions("gguf", "torch", "transformers")
    toolchain = {
        "llama.cpp": build["llama_cpp_commit"],
        "llama-cpp-python": llama_cpp.__version__,
        "llama-cpp-python-sdist-sha256": build["sdist_sha256"],
        "gguf": found.get("gguf"),
        "numpy": numpy.__version__,
        "python": sys.version.split()[0],
        "convert_hf_to_gguf.py-sha256": hashlib.sha256(converter.read_bytes()).hexdigest(),
    }
    for dist in ("torch", "transformers"):  # the converter reads checkpoints with these
        toolchain[dist] = found.get(dist)
    for name in TOOLS:
        path = llama_cpp_dir() / "bin" / name
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        toolchain[f"{name}-sha256"] = digest
    # a build whose tools share libraries (the GPU kit's CUDA tools, benchmarks/gpu/llama-cuda.sh):
    # those are the tools' code too (none beside the static tools scripts/setup.sh builds)
    for lib in sorted((llama_cpp_dir() / "bin").glob("lib*.so*")):
        toolchain[f"{lib.name}-sha256"] = hashlib.sha256(lib.read_bytes()).hexdigest()
    _ = gguf  # imported to prove the vendored gguf-py is importable here
    return {
        "toolchain": toolchain,
        # the deploy command's program as this host runs it (the serve check, the benchmark); where
        # setup did not build it, starting it fails naming this path
        "programs": {LLAMA_SERVER: str(llama_cpp_dir() / "bin" / LLAMA_SERVER)},
        "cmake_args": build.get("cmake_args"),
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "converter": str(converter),
    }


def op_convert(req: dict[str, Any]) -> dict[str, Any]:
    """HF checkpoint -> GGUF with llama.cpp's own convert_hf_to_gguf.py."""
    converter = llama_cpp_dir() / "convert_hf_to_gguf.py"
    out = Path(req["out_path"])
    cmd = [
        sys.executable,
        str(converter),
        req["model_dir"],
        "--outfile",
        str(out),
        "--outtype",
        req["outtype"],
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    sys.stdout.write(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.is_file():
        out.unlink(missing_ok=True)
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {_converter_error(proc.stderr)}")
    return {"seconds": time.perf_counter() - t0, "command": " ".join(cmd[1:])}


def _converter_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("ERROR:") or "Error" in ln.split(":")[0]:
            if "No space left on device" in ln:
                raise OSError(28, "No space left on device")
            return ln.removeprefix("ERROR:hf-to-gguf:")
    return lines[-1] if lines else "no output"


def _threads(req: dict[str, Any]) -> int:
    """The threads a request asks for; when it leaves it to us, the host's OpenMP budget
    (OMP_NUM_THREADS, which torch and the other tools follow too), else all cores."""
    budget = os.environ.get("OMP_NUM_THREADS", "")
    return req.get("threads") or (int(budget) if budget.isdigit() else 0) or os.cpu_count() or 1


def _perplexity(req: dict[str, Any], *args: str) -> list[str]:
    """A llama-perplexity command over req's GGUF in windows of req's ctx, plus `args` (split
    over req's `gpus` as its server is)."""
    ctx = str(req["ctx"])
    gpus = req.get("gpus", 1)
    split = ["-sm", req.get("split_mode", "layer"), "-ts", ",".join(["1"] * gpus)] if gpus > 1 else []
    return [str(tool("llama-perplexity")), "-m", req["gguf_path"], "-c", ctx, "-b", ctx,
            "-t", str(_threads(req)), *split, *args]  # fmt: skip


def split_settings(req: dict[str, Any]) -> dict[str, Any]:
    """llama_cpp.Llama's split over req's `gpus` (even shares, req's split mode); {} for one:
    llama.cpp's own default, which spreads layers over every visible GPU."""
    gpus = req.get("gpus", 1)
    if gpus <= 1:
        return {}
    return {"split_mode": LLAMACPP_SPLIT_MODES[req.get("split_mode", "layer")], "tensor_split": [1.0] * gpus}


def _run_tool(cmd: list[str], what: str) -> str:
    """Run a llama.cpp tool, its output into this step's log; RuntimeError with its last error line."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    out = proc.stdout + proc.stderr
    sys.stdout.write(f"$ {' '.join(cmd)}\n{out}\n[{time.perf_counter() - t0:.1f} s]\n")
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited with code {proc.returncode}: {_tool_error(out)}")
    return out


def _tool_error(out: str) -> str:
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "error" in ln.lower() or "failed" in ln.lower():
            return ln
    return lines[-1] if lines else "no output"


def _plain_text(path: str, tmp: Path) -> Path:
    """The tools read plain text: a .jsonl's `text` fields as a .txt beside the request."""
    if not path.endswith(".jsonl"):
        return Path(path)
    out = tmp / "text.txt"
    out.write_text(read_text(path))
    return out


def op_imatrix(req: dict[str, Any]) -> dict[str, Any]:
    """Importance matrix with llama-imatrix over the calibration chunks the transformers path would
    use (same selection, seed and length, in llama.cpp's tokens); written as llama.cpp's GGUF imatrix.
    llama-imatrix frames each chunk itself (BOS first where the GGUF says add_bos_token)."""
    import gguf
    import llama_cpp

    out = Path(req["out_path"])
    vocab = llama_cpp.Llama(model_path=req["base_path"], vocab_only=True, verbose=False)
    text = read_text(req["text_path"]).encode()
    ids = vocab.tokenize(text, add_bos=False, special=False)
    chunks = calibration_chunks(ids, req["samples"], req["seq_len"], req["seed"])
    selected = out.parent / "calibration.txt"
    selected.write_bytes(b"".join(vocab.detokenize(c) for c in chunks))
    cmd = [
        str(tool("llama-imatrix")),
        "-m", req["base_path"],
        "-f", str(selected),
        "-o", str(out),
        "-c", str(req["seq_len"]),
        "-b", str(req["seq_len"]),
        "--chunks", str(len(chunks)),
        "-t", str(_threads(req)),
        "--no-ppl",
    ]  # fmt: skip
    t0 = time.perf_counter()
    _run_tool(cmd, "llama-imatrix")
    if not out.is_file():
        raise RuntimeError(f"llama-imatrix wrote no {out.name}; see log")
    reader = gguf.GGUFReader(str(out))
    field = reader.get_field("imatrix.chunk_count")
    return {
        "seconds": time.perf_counter() - t0,
        "tensors": sum(t.name.endswith(".in_sum2") for t in reader.tensors),
        "chunks": int(field.contents()) if field else None,
        "tokens": sum(len(c) for c in chunks),
        "command": " ".join(Path(cmd[0]).name if i == 0 else a for i, a in enumerate(cmd)),
    }


def load_imatrix(path: str) -> dict[str, Any]:
    """Per-tensor importance vectors: an .npz of them (the transformers path) or llama.cpp's GGUF
    imatrix, normalised the way llama-quantize does (sum of squares / count, per expert)."""
    import numpy as np

    if not path.endswith(".gguf"):
        data = np.load(path)
        return {name: data[name] for name in data.files}
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    values = {}
    for name, sums in tensors.items():
        if not name.endswith(".in_sum2"):
            continue
        base = name.removesuffix(".in_sum2")
        counts = np.asarray(tensors[f"{base}.counts"].data, dtype=np.float32).reshape(-1)
        rows = np.asarray(sums.data, dtype=np.float32).reshape(len(counts), -1)
        safe = np.where(counts > 0, counts, 1.0)[:, None]
        values[base] = np.where(counts[:, None] > 0, rows / safe, 1.0).reshape(-1)
    return values


_KLD_STATS = {
    "ppl": "Mean PPL(Q)",
    "ppl_base": "Mean PPL(base)",
    "ln_ppl_ratio": "Mean ln(PPL(Q)/PPL(base))",
    "kld_mean": "Mean    KLD",
    "kld_max": "Maximum KLD",
    "kld_p99": "99.0%   KLD",
    "kld_median": "Median  KLD",
    "same_top_p_pct": "Same top p",
}


# llama-perplexity's output has stopped after the first chunk's line, exit code 0, no statistics
# and no error line, its output file whole (4 times in ~8 fresh-clone CI runs, 2026-12-04/05, under
# load; --kl-divergence and the base run alike). The cause is llama.cpp's own: its tools log through
# an asynchronous worker thread whose singleton is leaked at exit on purpose ("this design may cause
# logs to be lost if not flushed before the program exits", common/log.cpp common_log_main, issue
# 22142), and llama-perplexity returns from main without pausing it, so the last lines (the
# statistics) may never be written. The same command is deterministic: it is run again, up to
# KLD_ATTEMPTS times, and fails naming what it never printed.
KLD_ATTEMPTS = 3


def _run_until_printed(
    cmd: list[str], what: str, parse: Callable[[str], dict[str, Any] | str]
) -> tuple[dict[str, Any], str, int]:
    """Run llama-perplexity `cmd` until `parse` finds its numbers in the log (a dict; else a str
    saying what is missing), up to KLD_ATTEMPTS times: the numbers, the log, the runs it took.
    RuntimeError "`what` <missing> in N runs" when the last run lacks them too."""
    attempt = 1
    while True:
        log = _run_tool(cmd, what)
        got = parse(log)
        if isinstance(got, dict):
            return got, log, attempt
        if attempt == KLD_ATTEMPTS:
            raise RuntimeError(f"{what} {got} in {attempt} runs: {_tool_error(log)}")
        print(f"{what} exited 0 but {got} (its log lost at exit): again")
        attempt += 1


def op_kld_base(req: dict[str, Any]) -> dict[str, Any]:
    """llama-perplexity on the F16 GGUF over the evaluation text: its PPL, and the log-probabilities
    file (`--kl-divergence-base`) every quantized GGUF is compared against."""
    out = Path(req["out_path"])
    text = _plain_text(req["text_path"], out.parent)
    cmd = _perplexity(req, "-f", str(text), "--chunks", str(req["chunks"]), "--kl-divergence-base", str(out))

    def estimate(log: str) -> dict[str, Any] | str:
        found = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", log)
        if not found or not out.is_file():
            return "gave no perplexity"
        return {"ppl": float(found[1]), "ppl_stderr": float(found[2]), "chunks": _chunks(log)}

    # the runs it took stay in the step's log: this reply is cached beside the base, byte for byte
    return _run_until_printed(cmd, "llama-perplexity", estimate)[0]


def _kld_statistics(log: str) -> dict[str, Any] | str:
    """--kl-divergence's summary numbers (_KLD_STATS), or which one it never printed."""
    stats: dict[str, Any] = {}
    for key, label in _KLD_STATS.items():
        found = re.search(re.escape(label) + r"\s*:\s*(-?[\d.]+)", log)
        if not found:
            return f"printed no {label.split()[-1]}"
        stats[key] = float(found[1])
    return stats


def op_kld(req: dict[str, Any]) -> dict[str, Any]:
    """llama-perplexity --kl-divergence: a GGUF against the F16 base's log-probabilities."""
    cmd = _perplexity(req, "--kl-divergence-base", req["kld_base_path"], "--kl-divergence")
    stats, log, attempt = _run_until_printed(cmd, "llama-perplexity --kl-divergence", _kld_statistics)
    stats["ppl_delta_pct"] = 100.0 * (stats["ppl"] / stats["ppl_base"] - 1.0)
    stats["chunks"] = _chunks(log)
    stats["runs"] = attempt
    return stats


def _chunks(log: str) -> int | None:
    found = re.search(r"(?:calculating perplexity|computing) over (\d+) chunks", log)
    return int(found[1]) if found else None


def op_quantize(req: dict[str, Any]) -> dict[str, Any]:
    """F16 GGUF -> quantized GGUF with llama_model_quantize(), optionally with an imatrix."""
    import llama_cpp
    import numpy as np

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, GGUF_QUANTS[req["quant"]][1])
    params.nthread = _threads(req)
    keep_alive: list[Any] = []
    if req.get("imatrix_path"):
        data = load_imatrix(req["imatrix_path"])
        entries = (llama_cpp.llama_model_imatrix_data * (len(data) + 1))()
        for i, (name, values) in enumerate(data.items()):
            arr = np.ascontiguousarray(values, dtype=np.float32)
            key = name.encode()
            keep_alive += [arr, key]
            entries[i].name = key
            entries[i].data = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = arr.size
        entries[len(data)].name = None  # the list ends at a null name
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep_alive.append(entries)
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(
        req["in_path"].encode(), req["out_path"].encode(), ctypes.byref(params)
    )
    if rc != 0:
        Path(req["out_path"]).unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize to {req['quant']} failed (code {rc}); see log")
    return {"seconds": time.perf_counter() - t0}


def op_inspect(req: dict[str, Any]) -> dict[str, Any]:
    """What is really in a GGUF: architecture, file type, tensor types, matmul row sizes."""
    import gguf

    reader = gguf.GGUFReader(req["path"])
    arch_field = reader.get_field("general.architecture")
    arch = arch_field.contents() if arch_field else None
    types = Counter(t.tensor_type.name for t in reader.tensors)
    rows = {t.name: int(t.shape[0]) for t in reader.tensors if len(t.shape) == 2}
    tensor_bytes = {t.name: int(t.n_bytes) for t in reader.tensors}  # as stored: blocks and their scales
    return {
        "architecture": arch,
        "tensor_types": dict(types),
        "tensors": len(reader.tensors),
        "rows": rows,
        "tensor_bytes": tensor_bytes,
    }


def op_validate(req: dict[str, Any]) -> dict[str, Any]:
    """Score a GGUF in llama.cpp against the transformers reference (pipeline.workers.scoring)."""
    import llama_cpp
    import numpy as np

    ref = req["reference"]
    ctx = ref["ctx"]
    longest = max(len(g["prompt_ids"]) for g in ref["generations"]) + req["max_new_tokens"] + 8
    # Every layer on the GPU when this build of llama.cpp has a GPU backend; all cores otherwise
    # (llama-cpp-python's default is half of them).
    offload = bool(llama_cpp.llama_supports_gpu_offload())
    threads = _threads(req)
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=req["gguf_path"],
        n_ctx=max(ctx, longest),
        n_batch=ctx,
        logits_all=True,
        n_gpu_layers=-1 if offload else 0,
        n_threads=threads,
        n_threads_batch=threads,
        seed=0,
        verbose=False,
        **(split := split_settings(req)),
    )
    load_s = time.perf_counter() - t0
    scorer = WindowScorer(np.load(Path(req["reference_dir"]) / "logits.npy", mmap_mode="r"), ref)
    eval_ids = ref["eval_ids"]
    eval_s = 0.0
    for start, window in windows(eval_ids, ctx):
        llm.reset()
        t1 = time.perf_counter()
        llm.eval(window)
        eval_s += time.perf_counter() - t1
        scorer.add_logits(start, np.array(llm.scores[: ctx - 1]), window[1:])

    vocab_p = llama_cpp.llama_model_get_vocab(llm.model)
    records, gen_s = [], 0.0
    for g in ref["generations"]:
        llm.reset()
        out: list[int] = []
        t1 = time.perf_counter()
        for tok in llm.generate(g["prompt_ids"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            out.append(int(tok))
            if llama_cpp.llama_vocab_is_eog(vocab_p, tok) or len(out) >= req["max_new_tokens"]:
                break
        gen_s += time.perf_counter() - t1
        eos = bool(out) and llama_cpp.llama_vocab_is_eog(vocab_p, out[-1])
        shown = out[:-1] if eos else out  # the other engines' texts leave the end-of-turn token out
        text = llm.detokenize(shown).decode("utf-8", errors="replace")
        records.append(generation_record(g, out, text, eos))
    first_top = _top_logprobs(llm, ref["generations"][0]["prompt_ids"], records[0]["output_ids"])
    # llama.cpp's own framing of the evaluation text (BOS first where the GGUF says add_bos_token,
    # each window's head BOS, as llama-perplexity does) against the reference's ids
    text = Path(req["eval_text_path"]).read_text().encode()
    framed = llm.tokenize(text, add_bos=True, special=False)
    bos = llm.token_bos() if framed and framed[0] == llm.token_bos() else None
    ours_ids = [t for w in bos_windows(framed, ctx, bos) for t in w][: len(eval_ids)]
    return {
        **scorer.result(),
        **generation_scores(records, gen_s),
        "prompt_tokens_per_s": len(ref["eval_ids"]) / eval_s if eval_s else None,
        "load_s": load_s,
        "placement": {
            "gpu_offload": offload,
            "n_gpu_layers": -1 if offload else 0,
            "threads": threads,
            **({"gpus": req["gpus"], "split_mode": req["split_mode"]} if offload and split else {}),
        },
        "eos_token_id": llm.token_eos(),
        "tokenizer_prefix_match": common_prefix(ours_ids, eval_ids) / len(eval_ids),
        "first_generation_top_logprobs": first_top,
    }


def _top_logprobs(llm: Any, prompt: list[int], answer: list[int]) -> list[dict[str, float]]:
    """The TIE_TOP most likely tokens (id -> log-probability) at each step of a greedy `answer`
    (the serve check's near-ties), from one pass over prompt + answer."""
    import numpy as np

    if not answer:
        return []
    llm.reset()
    llm.eval(prompt + answer)
    rows = np.array(llm.scores[len(prompt) - 1 : len(prompt) - 1 + len(answer)], dtype=np.float64)
    peak = rows.max(axis=1, keepdims=True)
    logprobs = rows - (peak + np.log(np.exp(rows - peak).sum(axis=1, keepdims=True)))
    return [{str(int(t)): float(lp[t]) for t in np.argsort(lp)[::-1][:TIE_TOP]} for lp in logprobs]


def _ask_llama_server(base: str, req: dict[str, Any]) -> dict[str, Any]:
    """One greedy completion of the prompt's token ids through llama-server's own /completion
    (the one that answers with token ids; an end-of-generation token among them, as offline)."""
    body = {
        "prompt": req["prompt_ids"],
        "n_predict": req["max_tokens"],
        "temperature": 0,  # llama.cpp's temperature sampler keeps only the most likely token
        "return_tokens": True,
        "cache_prompt": False,
    }
    got = post_json(f"{base}/completion", body)
    ids = [int(t) for t in got.get("tokens") or []]
    return {"text": got["content"], "token_ids": ids, "finish_reason": got.get("stop_type")}


def op_serve_check(req: dict[str, Any]) -> dict[str, Any]:
    """The manifest's serve command (llama.cpp's llama-server), once (pipeline.workers.serving)."""
    return serve_check(req, "llama-server", _ask_llama_server)


if __name__ == "__main__":
    worker_main(
        {
            "toolchain": op_toolchain,
            "convert": op_convert,
            "quantize": op_quantize,
            "inspect": op_inspect,
            "validate": op_validate,
            "imatrix": op_imatrix,
            "kld_base": op_kld_base,
            "kld": op_kld,
            "serve_check": op_serve_check,
        }
    )
