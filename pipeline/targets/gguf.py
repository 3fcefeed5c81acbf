"""GGUF targets for llama.cpp: llama.cpp's converter, then llama_model_quantize(), then scoring."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from pipeline.constants import ENV_LLAMACPP, ENV_TRANSFORMERS, GGUF_BASE_OUTTYPE, GGUF_FILE, GGUF_QUANTS
from pipeline.engines.calibration import SELECTION_VERSION
from pipeline.hashing import file_sha256, json_sha256
from pipeline.recipe import GgufTarget, ServeSpec, TargetSpec
from pipeline.targets.base import (
    BuildContext,
    TargetBuilder,
    gate,
    register,
    removed_on_error,
    scored_metrics,
)

LLAMACPP = "pipeline.engines.llamacpp"
HF_REFERENCE = "pipeline.engines.hf_reference"


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


@register
class GgufBuilder(TargetBuilder):
    kind = "gguf"
    engine = "llama.cpp"
    format = "gguf"
    environments = (ENV_LLAMACPP,)

    def build(self, ctx: BuildContext, name: str, spec: TargetSpec, out: Path) -> dict[str, Any]:
        assert isinstance(spec, GgufTarget)
        step, arg = GGUF_QUANTS[spec.quant]
        dest = out / GGUF_FILE
        details: dict[str, Any] = {}
        if step == "convert" and arg == GGUF_BASE_OUTTYPE:
            _link_or_copy(self._base(ctx, name), dest)
        elif step == "convert":
            ctx.reporter.step(name, f"converting to {spec.quant}")
            ctx.worker(ENV_LLAMACPP, LLAMACPP, self._convert_request(ctx, dest, arg), name)
        else:
            base = self._base(ctx, name)
            request: dict[str, Any] = {
                "op": "quantize",
                "in_path": str(base),
                "out_path": str(dest),
                "quant": spec.quant,
                "threads": ctx.threads,
            }
            if spec.imatrix:
                imatrix, details["imatrix"] = self._imatrix(ctx, name, base)
                request["imatrix_path"] = str(imatrix)
            ctx.reporter.step(name, f"quantizing to {spec.quant}")
            ctx.worker(ENV_LLAMACPP, LLAMACPP, request, name)
        inspected = ctx.worker(ENV_LLAMACPP, LLAMACPP, {"op": "inspect", "path": str(dest)}, name)
        details["architecture"] = inspected["architecture"]
        details["tensor_types"] = inspected["tensor_types"]  # e.g. IQ4_XS files hold IQ4_NL tensors
        return {"quant": spec.quant, "gguf": details}

    def _convert_request(self, ctx: BuildContext, dest: Path, outtype: str) -> dict[str, Any]:
        return {"op": "convert", "model_dir": str(ctx.source.path), "out_path": str(dest), "outtype": outtype}

    def _base(self, ctx: BuildContext, name: str) -> Path:
        """The F16 conversion every quantized target starts from, cached per source + converter."""
        tc = ctx.toolchain(ENV_LLAMACPP)["toolchain"]
        key = json_sha256({"source": ctx.source.sha256, "toolchain": tc, "outtype": GGUF_BASE_OUTTYPE})
        base = ctx.layout.cache_dir / f"gguf-base-{GGUF_BASE_OUTTYPE}-{key[:16]}.gguf"
        if not base.is_file():
            ctx.reporter.step(name, "converting HF checkpoint to GGUF")
            base.parent.mkdir(parents=True, exist_ok=True)
            tmp = base.with_suffix(f".tmp-{os.getpid()}.gguf")
            with removed_on_error(tmp):
                ctx.worker(ENV_LLAMACPP, LLAMACPP, self._convert_request(ctx, tmp, GGUF_BASE_OUTTYPE), name)
            tmp.rename(base)
        return base

    def _imatrix(self, ctx: BuildContext, name: str, base: Path) -> tuple[Path, dict[str, Any]]:
        """Importance matrix from the recipe's calibration text, cached per inputs."""
        cal = ctx.loaded.recipe.calibration
        assert cal is not None  # the recipe schema requires it for imatrix targets
        text = ctx.loaded.text_path(cal.dataset)
        record = {
            "dataset": cal.dataset,
            "dataset_sha256": file_sha256(text),
            "samples": cal.samples,
            "seq_len": cal.seq_len,
            "seed": cal.seed,
        }
        tc = ctx.toolchain(ENV_TRANSFORMERS)
        key = json_sha256({**record, "base": base.name, "tc": tc, "selection": SELECTION_VERSION})[:16]
        path = ctx.layout.cache_dir / f"imatrix-{key}.npz"
        meta_path = path.with_suffix(".json")
        if not path.is_file():
            ctx.reporter.step(name, "computing importance matrix")
            inspected = ctx.worker(ENV_LLAMACPP, LLAMACPP, {"op": "inspect", "path": str(base)}, name)
            tmp = path.with_name(f"{path.stem}.tmp-{os.getpid()}.npz")
            with removed_on_error(tmp):
                result = ctx.worker(
                    ENV_TRANSFORMERS,
                    HF_REFERENCE,
                    {
                        "op": "imatrix",
                        "model_dir": str(ctx.source.path),
                        "trust_remote_code": ctx.loaded.recipe.source.trust_remote_code,
                        "text_path": str(text),
                        "samples": cal.samples,
                        "seq_len": cal.seq_len,
                        "seed": cal.seed,
                        "gguf_arch": inspected["architecture"],
                        "gguf_tensors": inspected["rows"],
                        "out_path": str(tmp),
                    },
                    name,
                )
                meta_path.write_text(json.dumps(result))
            tmp.rename(path)
        meta = json.loads(meta_path.read_text())
        return path, {
            **record,
            "sha256": file_sha256(path),
            "tensors": meta["tensors"],
            "chunks": meta["chunks"],
            "tokens": meta["tokens"],
            "computed_with": meta["toolchain"],
        }

    def validate(self, ctx: BuildContext, name: str, spec: TargetSpec, artifact: Path) -> dict[str, Any]:
        ref, ref_dir = ctx.reference()
        ctx.reporter.step(name, "validating in llama.cpp")
        r = ctx.loaded.recipe
        got = ctx.worker(
            ENV_LLAMACPP,
            LLAMACPP,
            {
                "op": "validate",
                "gguf_path": str(artifact / GGUF_FILE),
                "reference": ref,
                "reference_dir": str(ref_dir),
                "eval_text_path": str(ctx.loaded.text_path(r.evaluation.text)),
                "max_new_tokens": r.smoke.max_new_tokens,
                "threads": ctx.threads,
            },
            name,
        )
        metrics = {
            **scored_metrics(got, ref),
            "load_s": got["load_s"],
            "tokenizer_prefix_match": got["tokenizer_prefix_match"],
        }
        status, reason = gate(metrics, spec.gates)
        if got["eos_token_id"] not in ref["eos_token_ids"]:
            status = "failed"
            reason = f"GGUF eos token {got['eos_token_id']} is not the reference's {ref['eos_token_ids']}"
        return {
            "status": status,
            "reason": reason,
            "engine": "llama.cpp",
            "metrics": metrics,
            "gates": spec.gates.model_dump(),
            "generations": got["generations"],
            "reference": {"engine": "transformers", "toolchain": ref["toolchain"], "dtype": "float32"},
        }

    def serve_command(self, spec: TargetSpec, serve: ServeSpec) -> str:
        knobs = serve.llamacpp
        threads = f" --n_threads {knobs.n_threads}" if knobs.n_threads else ""
        return (
            f"python -m llama_cpp.server --model ${{ARTIFACT_DIR}}/{GGUF_FILE} --host {serve.host} "
            f"--port {serve.port} --n_ctx {knobs.n_ctx} --n_gpu_layers {knobs.n_gpu_layers}{threads}"
        )
