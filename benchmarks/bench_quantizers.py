"""Quantizers side by side on the default recipe's model (SmolLM2-135M), scored by the project's own
validation: prints a markdown table, asserts nothing.

Built as one recipe by `pipeline build` (same source, reference, calibration text, evaluation text
and smoke prompts as recipes/smollm2-135m.yaml; serving benchmark off; gates wide open so every
verdict carries its numbers):
- IQ4_XS with its importance matrix from llama.cpp's `llama-imatrix` vs the project's transformers
  hooks (same calibration chunks);
- AWQ and GPTQ W4A16 from llm-compressor vs GPTQModel, each pair on the same calibration samples;
- llm-compressor AWQ with the default recipe's CPU shortcut (n_grid 5, 8 x 128 tokens) vs fuller
  settings (n_grid 20, --awq-full-samples x --awq-full-seq-len).

Usage: .venv/bin/python benchmarks/bench_quantizers.py [--work DIR] [--out FILE.md] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.constants import MANIFEST_NAME  # noqa: E402
from pipeline.project import Project  # noqa: E402

WIDE_GGUF = {"max_ppl_delta_pct": 1000.0, "max_kld_mean": 100.0}
WIDE_INT4 = {"max_ppl_delta_pct": 1000.0, "max_kld_topk_mean": 100.0}


def targets(full_samples: int, full_seq_len: int) -> dict[str, dict[str, Any]]:
    """The compared targets: the default recipe's settings, varied in one thing per pair."""
    recipe = yaml.safe_load((REPO / "recipes" / "smollm2-135m.yaml").read_text())["targets"]
    awq = {k: v for k, v in recipe["awq"].items() if k != "gates"} | {"gates": WIDE_INT4}
    gptq = {k: v for k, v in recipe["gptq"].items() if k != "gates"} | {"gates": WIDE_INT4}
    iq4 = {k: v for k, v in recipe["gguf-iq4_xs"].items() if k not in ("gates", "imatrix_tool")}
    iq4["gates"] = WIDE_GGUF
    full = {"samples": full_samples, "seq_len": full_seq_len}
    return {
        "iq4_xs-llama-imatrix": iq4 | {"imatrix_tool": "llama-imatrix"},
        "iq4_xs-transformers": iq4 | {"imatrix_tool": "transformers"},
        "awq-llmcompressor": awq | {"backend": "llm-compressor"},
        "awq-gptqmodel": awq | {"backend": "gptqmodel"},
        "awq-llmcompressor-full": awq | {"backend": "llm-compressor", "n_grid": 20, "calibration": full},
        "gptq-llmcompressor": gptq | {"backend": "llm-compressor"},
        "gptq-gptqmodel": gptq | {"backend": "gptqmodel"},
    }


def write_recipe(work: Path, chosen: dict[str, dict[str, Any]]) -> Path:
    base = yaml.safe_load((REPO / "recipes" / "smollm2-135m.yaml").read_text())
    base.update(name="bench-quantizers", targets=chosen, serving_benchmark={"enabled": False})
    path = work / "bench-quantizers.yaml"
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


def row(name: str, m: dict[str, Any]) -> dict[str, Any]:
    """One table row from a manifest: how it was made, what it cost, how close it is."""
    v = m["validation"]
    metrics = v.get("metrics") or {}
    steps = m["build"]["steps"]
    made = [s for s in steps if s["op"] in ("quantize", "imatrix")]
    q = m.get("quantization") or {}
    gguf = m.get("gguf") or {}
    llama = v["engines"].get("llama.cpp", {}).get("details", {}).get("llama_perplexity") or {}
    cal = q.get("calibration") or gguf.get("imatrix") or {}
    samples = cal.get("chunks") or cal.get("samples")  # what was used (a short text gives fewer)
    weights = [f for f in m["files"] if f["path"].endswith((".gguf", ".safetensors"))]
    return {
        "target": name,
        "tool": q.get("library") or f"llama.cpp + {gguf.get('imatrix', {}).get('tool')}",
        "version": q.get("library_version") or m["toolchain"]["llamacpp"]["llama.cpp"][:10],
        "calibration": f"{samples} x {cal.get('seq_len')}",
        "quantize_s": sum(s["seconds"] for s in made),
        "peak_rss_mib": max((s["peak_rss_mib"] for s in made), default=0.0),
        "mib": sum(f["bytes"] for f in weights) / 2**20,
        "ppl_delta_pct": metrics.get("ppl_delta_pct"),
        "kld": metrics.get("kld_mean")
        if metrics.get("kld_mean") is not None
        else metrics.get("kld_topk_mean"),
        "top1": metrics.get("top1_agreement"),
        "llama_ppl_delta_pct": llama.get("ppl_delta_pct"),
        "llama_kld": llama.get("kld_mean"),
        "status": v["status"],
        "build_s": m["build"]["seconds"],
    }


def fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| target | quantizer | version | calibration | quantize s | peak RSS MiB | weights MiB | "
        "ΔPPL % vs fp32 ref | KLD vs fp32 ref | top-1 agree | llama-perplexity ΔPPL % vs F16 | "
        "llama-perplexity KLD vs F16 | verdict |\n|" + "---|" * 13
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['target']} | {r['tool']} | {r['version']} | {r['calibration']} | "
            f"{r['quantize_s']:.0f} | {r['peak_rss_mib']:.0f} | {r['mib']:.0f} | "
            f"{fmt(r['ppl_delta_pct'], '+.2f')} | {fmt(r['kld'], '.4f')} | {fmt(r['top1'], '.3f')} | "
            f"{fmt(r['llama_ppl_delta_pct'], '+.2f')} | {fmt(r['llama_kld'], '.4f')} | {r['status']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--work", default=str(REPO / "bench-out" / "quantizers"))
    parser.add_argument("--out", help="also write the markdown here")
    parser.add_argument("--only", nargs="*", help="build only these targets")
    parser.add_argument("--awq-full-samples", type=int, default=32)
    parser.add_argument("--awq-full-seq-len", type=int, default=256)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    chosen = targets(args.awq_full_samples, args.awq_full_seq_len)
    recipe = write_recipe(work, chosen)
    project = Project.open(recipe, root=work / "artifacts")
    results = project.build(args.only or None)
    rows = []
    for result in results:
        manifest = work / "artifacts" / "bench-quantizers" / result.target / MANIFEST_NAME
        if not manifest.is_file():
            print(f"{result.target}: {result.outcome} {result.message or ''}", file=sys.stderr)
            continue
        rows.append(row(result.target, json.loads(manifest.read_text())))
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    text = (
        f"# Quantizers side by side, {datetime.date.today()} (`benchmarks/bench_quantizers.py`)\n\n"
        f"Commit {commit.stdout.strip()}, {platform.processor() or platform.machine()}, "
        f"{sum(r['build_s'] for r in rows):.0f} s of builds + validations for {len(rows)} targets. "
        "Model: SmolLM2-135M-Instruct (default recipe source); "
        "reference: transformers fp32 on the evaluation text (`builtin:apache-2.0`, 1024 tokens, ctx 512); "
        "calibration text `builtin:gpl-3.0`. KLD vs the fp32 reference is full-vocabulary for GGUF "
        "(llama.cpp) and the top-64 lower bound for W4A16 (vLLM). `quantize s`: the imatrix and "
        "quantize steps for GGUF rows, the quantizer step for W4A16 rows; `calibration`: the chunks "
        "really used x their length (the calibration text holds 29 x 256 tokens).\n\n" + table(rows) + "\n"
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
