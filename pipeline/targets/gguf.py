"""GGUF targets for llama.cpp: llama.cpp's converter, then llama_model_quantize(), then scoring."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import field_validator, model_validator

from pipeline.artifacts import clone_file, read_key
from pipeline.constants import (
    ENGINE_LLAMACPP,
    ENV_LLAMACPP,
    ENV_TRANSFORMERS,
    GGUF_BASE_OUTTYPE,
    GGUF_FILE,
    GGUF_QUANTS,
    LLAMA_SERVER,
)
from pipeline.context import BuildContext
from pipeline.decode_bound import weights_read_per_token
from pipeline.engines.serving import ARTIFACT_DIR, OfflineMode, serve_check
from pipeline.hashing import file_sha256
from pipeline.manifest import Metrics, Validation
from pipeline.spec import ServeSpec
from pipeline.targets.base import BuildOutput, Target, register
from pipeline.validation import reference_record, verdict
from pipeline.workers.calibration import SELECTION_VERSION

BASE_FILE = "base.gguf"
IMATRIX_FILES = {"llama-imatrix": "imatrix.gguf", "transformers": "imatrix.npz"}
KLD_BASE_FILE = "kld-base.bin"
# The self-check against llama.cpp's own tool: the gated numbers and llama-perplexity's are on the
# same windows and positions, so they may differ only by these; beyond either, the verdict fails
# naming both numbers. Measured on SmolLM2 (2-core Xeon, 2026-12-03): F16 0.007 %, Q4_0 0.03 %, but
# Q8_0 0.61 % and IQ4_XS 0.56 % (llama-cpp-python's wheel and the tools are two builds of llama.cpp;
# their Q8_0/IQ4_XS paths differ, not yet explained); the fp32 reference vs the F16 GGUF 0.004 %.
SAME_GGUF_PPL_RTOL = 0.01  # the artifact's PPL: llama-cpp-python vs llama-perplexity
REFERENCE_BASE_PPL_RTOL = 0.01  # the reference's PPL (fp32 or bf16 transformers) vs llama-perplexity's F16
# llama-cpp-python scores without flash attention (its default); llama-server's default, auto, turns
# it on where the backend has it: the serve check runs the server without it too
OFFLINE = OfflineMode("flash-attention-off", ("-fa", "off"))


@register
class GgufTarget(Target):
    """A GGUF file for llama.cpp, converted and quantized by llama.cpp itself.

    ```yaml
    gguf-iq4_xs: {kind: gguf, quant: IQ4_XS, imatrix: true,
                  gates: {max_ppl_delta_pct: 15, max_kld_mean: 0.15}}
    ```

    `imatrix_tool`: llama.cpp's `llama-imatrix` on the F16 GGUF, or the project's transformers hooks
    on the source checkpoint (benchmarks/bench_quantizers.py compares them). Validation scores the
    file twice: against the transformers reference (the gated metrics) and with llama-perplexity
    against the F16 GGUF (`validation.engines.llama.cpp.details.llama_perplexity`).
    """

    kind: Literal["gguf"]
    quant: str
    imatrix: bool = False
    imatrix_tool: Literal["llama-imatrix", "transformers"] = "llama-imatrix"

    engine: ClassVar[str] = ENGINE_LLAMACPP
    format: ClassVar[str] = "gguf"
    environments: ClassVar[tuple[str, ...]] = (ENV_LLAMACPP,)

    @field_validator("quant")
    @classmethod
    def _known_quant(cls, value: str) -> str:
        if value not in GGUF_QUANTS:
            raise ValueError(f"unknown GGUF quant {value!r} (known: {', '.join(GGUF_QUANTS)})")
        return value

    @model_validator(mode="after")
    def _imatrix_needs_quantizer(self) -> GgufTarget:
        if self.imatrix and GGUF_QUANTS[self.quant][0] != "quantize":
            raise ValueError(f"imatrix only applies to quantized types, not {self.quant}")
        return self

    @property
    def needs_calibration(self) -> bool:
        return self.imatrix

    def recorded_environments(self) -> tuple[str, ...]:
        if self.imatrix and self.imatrix_tool == "transformers":
            return (*self.environments, ENV_TRANSFORMERS)
        return self.environments

    def build(self, ctx: BuildContext, name: str, out: Path) -> BuildOutput:
        step, arg = GGUF_QUANTS[self.quant]
        dest = out / GGUF_FILE
        details: dict[str, Any] = {}
        if step == "convert" and arg == GGUF_BASE_OUTTYPE:
            clone_file(self._base(ctx, name), dest)  # not a hard link: the cache stays the cache's
        elif step == "convert":
            ctx.reporter.step(name, f"converting to {self.quant}")
            ctx.step(ENV_LLAMACPP, _convert_request(ctx, dest, arg), name)
        else:
            base = self._base(ctx, name)
            request: dict[str, Any] = {
                "op": "quantize",
                "in_path": str(base),
                "out_path": str(dest),
                "quant": self.quant,
                "threads": ctx.threads,
            }
            if self.imatrix:
                imatrix, details["imatrix"] = self._imatrix(ctx, name, base)
                request["imatrix_path"] = str(imatrix)
            ctx.reporter.step(name, f"quantizing to {self.quant}")
            ctx.step(ENV_LLAMACPP, request, name)
        inspected = ctx.step(ENV_LLAMACPP, {"op": "inspect", "path": str(dest)}, name)
        details["architecture"] = inspected["architecture"]
        details["tensor_types"] = inspected["tensor_types"]  # e.g. IQ4_XS files hold IQ4_NL tensors
        return BuildOutput(quant=self.quant, gguf=details)

    def _base(self, ctx: BuildContext, name: str) -> Path:
        """The F16 conversion every quantized target starts from, cached per source + converter."""

        def convert(tmp: Path) -> None:
            ctx.reporter.step(name, "converting HF checkpoint to GGUF")
            ctx.step(ENV_LLAMACPP, _convert_request(ctx, tmp / BASE_FILE, GGUF_BASE_OUTTYPE), name)

        inputs = {"source": ctx.source.sha256, "toolchain": cache_versions(ctx, ENV_LLAMACPP)}
        return ctx.cached(f"gguf-base-{GGUF_BASE_OUTTYPE}", inputs, convert) / BASE_FILE

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

        env = ENV_LLAMACPP if self.imatrix_tool == "llama-imatrix" else ENV_TRANSFORMERS
        file = IMATRIX_FILES[self.imatrix_tool]

        def compute(tmp: Path) -> None:
            ctx.reporter.step(name, f"computing importance matrix ({self.imatrix_tool})")
            request: dict[str, Any] = {
                "op": "imatrix",
                "text_path": str(text),
                "samples": cal.samples,
                "seq_len": cal.seq_len,
                "seed": cal.seed,
                "out_path": str(tmp / file),
            }
            if self.imatrix_tool == "llama-imatrix":
                request |= {"base_path": str(base), "threads": ctx.threads}
            else:
                inspected = ctx.step(ENV_LLAMACPP, {"op": "inspect", "path": str(base)}, name)
                request |= {
                    "model_dir": str(ctx.source.path),
                    "trust_remote_code": ctx.loaded.recipe.source.trust_remote_code,
                    "gguf_arch": inspected["architecture"],
                    "gguf_tensors": inspected["rows"],
                }
            result = ctx.step(env, request, name)
            (tmp / "imatrix.json").write_text(json.dumps({**result, "toolchain": ctx.versions(env)}))

        inputs = {
            **record,
            "tool": self.imatrix_tool,
            "base": read_key(base.parent),  # the F16 base's own inputs (not a hash of its 15 GB at 7B)
            "toolchain": cache_versions(ctx, env),
            "selection": SELECTION_VERSION,
        }
        path = ctx.cached(f"imatrix-{self.imatrix_tool}", inputs, compute)
        meta = json.loads((path / "imatrix.json").read_text())
        return path / file, {
            **record,
            "tool": self.imatrix_tool,
            "sha256": file_sha256(path / file),
            "tensors": meta["tensors"],
            "chunks": meta["chunks"],
            "tokens": meta["tokens"],
            "computed_with": meta["toolchain"],
        }

    def validate(self, ctx: BuildContext, name: str, artifact: Path) -> Validation:
        ref, ref_dir = ctx.reference()
        ctx.reporter.step(name, "validating in llama.cpp")
        r = ctx.loaded.recipe
        got = ctx.step(
            ENV_LLAMACPP,
            {
                "op": "validate",
                "gguf_path": str(artifact / GGUF_FILE),
                "reference": ref,
                "reference_dir": str(ref_dir),
                "eval_text_path": str(ctx.loaded.text_path(r.evaluation.text)),
                "max_new_tokens": r.smoke.max_new_tokens,
                "threads": ctx.threads,
                **split_request(ctx.serve(name)),
            },
            name,
        )
        extra = {"load_s": got["load_s"], "tokenizer_prefix_match": got["tokenizer_prefix_match"]}
        result = verdict(
            ctx,
            ENGINE_LLAMACPP,
            got,
            ref,
            self.gates,
            extra,
            placement=got["placement"],
            metrics_tool="llama-cpp-python's logits against the transformers reference",
            llama_perplexity=self._llama_perplexity(ctx, name, artifact),
        )
        problems = disagreements(result.metrics, result.details["llama_perplexity"])
        if got["eos_token_id"] not in ref["eos_token_ids"]:
            eos = got["eos_token_id"]
            problems.append(f"GGUF eos token {eos} is not the reference's {ref['eos_token_ids']}")
        if problems:
            result.status = "failed"
            result.reason = "; ".join([result.reason, *problems] if result.reason else problems)
        ctx.reporter.step(name, "serving once through llama-server")
        serve_check(ctx, ENV_LLAMACPP, name, artifact, self.serve_argv, got, result, OFFLINE)
        return Validation.of(ENGINE_LLAMACPP, {ENGINE_LLAMACPP: result}, reference_record(ref))

    def _llama_perplexity(self, ctx: BuildContext, name: str, artifact: Path) -> dict[str, Any]:
        """llama-perplexity's PPL and KL divergence of the artifact against the F16 GGUF, over the
        evaluation text (evaluation.tokens // evaluation.ctx chunks; llama.cpp scores the second
        half of each). The F16 run's log-probabilities are computed once per base and text."""
        ev = ctx.loaded.recipe.evaluation
        base = self._base(ctx, name)
        text = ctx.loaded.text_path(ev.text)
        chunks = max(1, ev.tokens // ev.ctx)

        def compute(tmp: Path) -> None:
            ctx.reporter.step(name, "llama-perplexity on the F16 GGUF (KL divergence base)")
            request = {
                "op": "kld_base",
                "gguf_path": str(base),
                "text_path": str(text),
                "ctx": ev.ctx,
                "chunks": chunks,
                "threads": ctx.threads,
                "out_path": str(tmp / KLD_BASE_FILE),
            }
            (tmp / "kld-base.json").write_text(json.dumps(ctx.step(ENV_LLAMACPP, request, name)))

        inputs = {
            "base": read_key(base.parent),
            "eval_text": file_sha256(text),
            "ctx": ev.ctx,
            "chunks": chunks,
            "toolchain": cache_versions(ctx, ENV_LLAMACPP),
        }
        kld_base = ctx.cached(f"gguf-kld-base-{GGUF_BASE_OUTTYPE}", inputs, compute)
        ctx.reporter.step(name, "llama-perplexity --kl-divergence against the F16 GGUF")
        request = {
            "op": "kld",
            "gguf_path": str(artifact / GGUF_FILE),
            "kld_base_path": str(kld_base / KLD_BASE_FILE),
            "ctx": ev.ctx,
            "threads": ctx.threads,
            **split_request(ctx.serve(name)),
        }
        scores = ctx.step(ENV_LLAMACPP, request, name)
        base_run = json.loads((kld_base / "kld-base.json").read_text())
        return {
            "tool": "llama-perplexity",
            "base": f"{GGUF_BASE_OUTTYPE} GGUF of the source",
            "ctx": ev.ctx,
            "tokens_scored": (scores["chunks"] or chunks) * (ev.ctx - 1 - ev.ctx // 2),
            **scores,
            # the F16 run's own PPL, from its full logits: `ppl_base` is recomputed from the base
            # file, which keeps each position's log-probabilities down to 16 nats below its top one
            # only (perplexity.cpp process_logits); a near-random model's tokens fall below that
            "ppl_base_run": base_run["ppl"],
        }

    def shards_by_recipe(self) -> bool:
        return False  # llama.cpp splits a GGUF over GPUs only where the target's own tp_size says so

    def weights_read_per_token(self, ctx: BuildContext, name: str, artifact: Path) -> int:
        """From the GGUF's tensor table (gguf-py, in the llama.cpp environment)."""
        inspected = ctx.step(ENV_LLAMACPP, {"op": "inspect", "path": str(artifact / GGUF_FILE)}, name)
        return weights_read_per_token(inspected["tensor_bytes"])

    def serve_argv(self, serve: ServeSpec) -> list[str]:
        """llama.cpp's own `llama-server` (a deploy host's build of the commit the toolchain names;
        here, the build's copy): the knobs whose defaults depend on the host (auto slots, auto GPU
        layers) explicit, the others (flash attention, batch sizes, prompt cache) llama.cpp's."""
        knobs = serve.llamacpp
        layers = "all" if knobs.n_gpu_layers == -1 else str(knobs.n_gpu_layers)
        argv = [LLAMA_SERVER, "-m", f"{ARTIFACT_DIR}/{GGUF_FILE}", "--host", serve.host]
        argv += [
            "--port",
            str(serve.port),
            "-c",
            str(knobs.n_ctx),
            "-np",
            str(knobs.parallel),
            "-ngl",
            layers,
        ]
        if serve.tp_size > 1:  # even shares of the first tp_size GPUs
            argv += ["-sm", knobs.split_mode, "-ts", ",".join(["1"] * serve.tp_size)]
        argv += ["-t", str(knobs.n_threads)] if knobs.n_threads else []
        argv += ["--kv-unified"] if knobs.kv_unified else []
        argv += ["--cache-ram", str(knobs.cache_ram_mib)] if knobs.cache_ram_mib is not None else []
        return argv


def cache_versions(ctx: BuildContext, env: str) -> dict[str, str | None]:
    """env's versions as a shared cache's key (the F16 base, the imatrix, the KL base): all but
    the server's, which makes none of them (its build moves each GGUF target's own hash only)."""
    return {k: v for k, v in ctx.versions(env).items() if not k.startswith((LLAMA_SERVER, "libllama-server"))}


def split_request(serve: ServeSpec) -> dict[str, Any]:
    """The llama.cpp worker's split over the GPUs the target is served on (none at 1)."""
    if serve.tp_size <= 1:
        return {}
    return {"gpus": serve.tp_size, "split_mode": serve.llamacpp.split_mode}


def disagreements(metrics: Metrics | None, by_llama: dict[str, Any]) -> list[str]:
    """Where the gated numbers and llama-perplexity's disagree beyond the measured tolerances."""
    if metrics is None:
        return []
    found = []
    checks = (
        ("the GGUF's PPL", metrics.ppl, by_llama["ppl"], SAME_GGUF_PPL_RTOL, "llama-perplexity's"),
        ("the reference's PPL", metrics.ppl_ref, by_llama["ppl_base_run"], REFERENCE_BASE_PPL_RTOL,
         "llama-perplexity's on the F16 GGUF"),
    )  # fmt: skip
    for what, ours, theirs, rtol, whose in checks:
        if not abs(ours / theirs - 1.0) <= rtol:
            found.append(f"{what} {ours:.4f} disagrees with {whose} {theirs:.4f} (beyond {rtol:.1%})")
    return found


def _convert_request(ctx: BuildContext, dest: Path, outtype: str) -> dict[str, Any]:
    return {"op": "convert", "model_dir": str(ctx.source.path), "out_path": str(dest), "outtype": outtype}
