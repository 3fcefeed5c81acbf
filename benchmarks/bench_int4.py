"""AWQ/GPTQ benchmark: prints numbers, asserts nothing.

(a) quantization wall time and peak RSS per method on SmolLM2 (the default recipe's settings),
    each run as the same worker process `pipeline build` starts, in its own environment;
(b) one table of size / ΔPPL / KLD / tokens/s across every artifact of the default recipe
    (GGUF ones included), read from the manifests of an `artifacts/` tree built beforehand.

Usage: .venv/bin/python benchmarks/bench_int4.py [--artifacts artifacts] [--skip-quantize]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gguf import REPO, default_source, run_sampled

from pipeline.environments import environment
from pipeline.project import Project
from pipeline.targets.int4 import Int4Target


def bench_quantize(work: Path) -> None:
    print("== (a) llm-compressor quantization of SmolLM2-135M (default recipe settings), one process each")
    project = Project.open(REPO / "recipes" / "smollm2-135m.yaml", root=work / "artifacts")
    ctx = project.context()
    source = default_source(work)
    print(f"  {'method':>6} {'samples x len':>14} {'wall':>7} {'peak RSS':>9} {'peak anon':>10}")
    for method in ("awq", "gptq"):
        spec = project.loaded.recipe.targets[method]
        assert isinstance(spec, Int4Target)
        out = work / f"q-{method}"
        shutil.rmtree(out, ignore_errors=True)
        request = spec.quantize_request(ctx, source, out)
        samples, seq_len = request["samples"], request["seq_len"]
        with tempfile.TemporaryDirectory() as tmp:
            req, res = Path(tmp) / "req.json", Path(tmp) / "res.json"
            req.write_text(json.dumps(request))
            env = environment("llmcompressor")
            cmd = [env.interpreter, "-m", env.worker, str(req), str(res)]
            wall, peaks, rc = run_sampled(cmd, {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
            result = json.loads(res.read_text()) if res.is_file() else {"error": f"exit {rc}"}
        if "error" in result:
            print(f"  {method:>6} failed: {result['error']}")
            continue
        gib = 1 << 30
        print(
            f"  {method:>6} {samples:>6} x {seq_len:<5} {wall:>6.0f}s {peaks['maxrss'] / gib:>8.2f}G "
            f"{peaks['RssAnon'] / gib:>9.2f}G"
        )
        shutil.rmtree(out)


def artifact_table(root: Path) -> None:
    print(f"== (b) every artifact of the default recipe ({root / 'smollm2-135m'})")
    head = ("target", "engine", "quant", "MiB", "ΔPPL %", "KLD", "tok/s", "status")
    print("  {:<12} {:<10} {:<18} {:>6} {:>8} {:>7} {:>7} {:>7}".format(*head))
    for manifest_path in sorted((root / "smollm2-135m").glob("*/manifest.json")):
        m = json.loads(manifest_path.read_text())
        v = m["validation"]
        metrics = v.get("metrics") or {}
        kld = metrics.get("kld_mean") if metrics.get("kld_mean") is not None else metrics.get("kld_topk_mean")
        nan = float("nan")
        size = sum(f["bytes"] for f in m["files"] if not f["path"].startswith("tokenizer")) / (1 << 20)
        print(
            f"  {m['target']:<12} {m['engine']:<10} {m['quant']:<18} {size:>6.0f} "
            f"{metrics.get('ppl_delta_pct', nan):>+8.2f} {kld if kld is not None else nan:>7.4f} "
            f"{metrics.get('tokens_per_s') or nan:>7.1f} {v['status']:>7}"
        )
    print("  (ΔPPL vs the fp32 transformers reference; KLD for vLLM rows: kld_topk_mean, a lower bound)")


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--artifacts", default=str(REPO / "artifacts"))
    parser.add_argument("--workdir", default=str(REPO / "bench-out"))
    parser.add_argument("--skip-quantize", action="store_true")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if not args.skip_quantize:
        bench_quantize(work)
    artifact_table(Path(args.artifacts))


if __name__ == "__main__":
    main()
