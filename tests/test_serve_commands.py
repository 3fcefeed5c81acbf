"""Serve commands as the manifest records them: run by a deploy job's shell, every value arrives
as one argument and nothing in a value runs (pipeline.engines.serving.command_line), and the serve
check and the serving benchmark run the same argument list, built for a loopback port (never a
recorded command parsed back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

import pipeline.targets  # noqa: F401  (registers the kinds in KINDS)
from pipeline.engines import sglang
from pipeline.engines.serving import ARTIFACT_DIR, command_line, local_argv
from pipeline.spec import KINDS, ServeSpec
from pipeline.workers.serving import run_argv


def test_a_recorded_serve_command_runs_exactly_its_argv_through_sh(tmp_path: Path) -> None:
    """What a deploy job does with `serve.command`: ${ARTIFACT_DIR} set, the line run by `sh -c`.
    Every value arrives as one argument, and nothing in a value runs."""
    probe = [sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))"]
    values = ["a b", "x; touch pwned #", "$(touch pwned)", "`touch pwned`", "it's", "", ARTIFACT_DIR]
    values.append(f"{ARTIFACT_DIR}/model dir/m.gguf")
    artifact = tmp_path / "artifact"
    env = {**os.environ, "ARTIFACT_DIR": str(artifact)}
    run = subprocess.run(
        ["sh", "-c", command_line(probe + values)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == [*values[:-2], str(artifact), f"{artifact}/model dir/m.gguf"]
    assert not (tmp_path / "pwned").exists()
    # the serve check's worker substitutes inside arguments: a path with spaces stays one argument
    argv = ["python", "-m", "m", "--model", f"{ARTIFACT_DIR}/m.gguf", "--port", "1"]
    assert run_argv(argv, "/a b", python="py") == ["py", "-m", "m", "--model", "/a b/m.gguf", "--port", "1"]
    assert run_argv(["trtllm-serve", ARTIFACT_DIR], "/x") == ["trtllm-serve", "/x"]


FULL_KL, TOP_K_KL = (
    {"max_ppl_delta_pct": 1.0, "max_kld_mean": 0.1},
    {"max_ppl_delta_pct": 1.0, "max_kld_topk_mean": 0.1},
)


def test_every_kind_builds_its_local_command_instead_of_patching_the_recorded_one() -> None:
    """The serve check and the benchmark run the deploy command with the recipe's knobs on a
    loopback port: the same builder, another host and port, the program this host's copy of it
    (llama-server: the one the build made), everything else as recorded."""
    serve = ServeSpec(host="0.0.0.0", port=8000)
    specs = {
        "gguf": {"quant": "Q8_0", "gates": FULL_KL}, "awq": {"gates": TOP_K_KL}, "gptq": {"gates": TOP_K_KL},
        "modelopt": {"quant": "fp8", "gates": TOP_K_KL},
        "trtllm": {"quant": "fp16", "gpu_arch": "sm90", "gates": FULL_KL},
    }  # fmt: skip
    programs = {"llama-server": "/opt/llama.cpp/bin/llama-server"}  # as a toolchain names them
    for kind, fields in specs.items():
        target = KINDS[kind].model_validate({"kind": kind, **fields})
        deployed, local = (
            target.serve_argv(serve),
            local_argv(target.serve_argv, serve, 5555, lambda p: programs.get(p, p)),
        )
        assert target.serve_command(serve) == command_line(deployed)
        assert len(local) == len(deployed), kind
        assert local[0] == (programs["llama-server"] if kind == "gguf" else deployed[0]), kind
        changed = [(d, x) for d, x in zip(deployed[1:], local[1:], strict=True) if d != x]
        assert changed == [("0.0.0.0", "127.0.0.1"), ("8000", "5555")], (kind, changed)


def test_each_engine_reads_only_its_own_knobs() -> None:
    """trtllm-serve's --max_seq_len comes from `serve.trtllm`, never from vLLM's knobs."""
    target = KINDS["modelopt"].model_validate({"kind": "modelopt", "quant": "int4_awq", "gates": FULL_KL})
    serve = ServeSpec(vllm={"max_model_len": 1024}, trtllm={"max_seq_len": 2048})
    argv = target.serve_argv(serve)
    assert argv[0] == "trtllm-serve" and argv[argv.index("--max_seq_len") + 1] == "2048"
    assert "1024" not in argv


def test_tp_size_reaches_both_engines_commands_and_leaves_size_one_as_it_was() -> None:
    """`serve.tp_size` > 1 shards the server over GPUs (vLLM --tensor-parallel-size, SGLang --tp);
    at 1 no flag is added, so no recorded command, and no inputs hash, changes."""
    awq = KINDS["awq"].model_validate(
        {"kind": "awq", "gates": {"max_ppl_delta_pct": 10, "max_kld_topk_mean": 1}}
    )
    one, two = ServeSpec(), ServeSpec(tp_size=2)
    assert "--tensor-parallel-size" not in awq.serve_argv(one)
    argv = awq.serve_argv(two)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    sglang_argv = sglang.serve_argv(two, None, "float16")
    assert sglang_argv[sglang_argv.index("--tp") + 1] == "2" and "--tp" not in sglang.serve_argv(
        one, None, "float16"
    )


def test_cpu_tensor_parallel_workers_each_get_a_slice_of_the_cores() -> None:
    from pipeline.workers.vllm import cpu_binding

    assert cpu_binding(2, [0, 1]) == "0|1"
    assert cpu_binding(2, [0, 1, 2, 3, 4]) == "0-1|2-3"
    assert cpu_binding(2, [0, 2, 4, 6]) == "0,2|4,6"
    with pytest.raises(
        RuntimeError, match="tensor_parallel_size 4 needs at least 4 CPU cores; this process has 2"
    ):
        cpu_binding(4, [0, 1])


def test_a_targets_own_tp_size_beats_the_recipes_and_moves_no_inputs_hash() -> None:
    """A target's `tp_size` is the GPUs its server shards it over, whatever `serve.tp_size` says:
    vLLM and SGLang's tensor parallelism, llama.cpp's split over GPUs, trtllm-serve's. Unset,
    the spec dumps as before (its inputs hash unchanged); the serve command carries the size."""
    gates = {"max_ppl_delta_pct": 10, "max_kld_topk_mean": 1}
    awq = KINDS["awq"].model_validate({"kind": "awq", "gates": gates, "tp_size": 4})
    plain = KINDS["awq"].model_validate({"kind": "awq", "gates": gates})
    assert "tp_size" not in plain.model_dump() and "tp_size" not in awq.model_dump()
    recipe_serve = ServeSpec(tp_size=2)
    assert plain.serve_spec(recipe_serve) is recipe_serve and awq.serve_spec(recipe_serve).tp_size == 4
    argv = awq.serve_argv(awq.serve_spec(ServeSpec()))
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    fp4 = KINDS["modelopt"].model_validate(
        {"kind": "modelopt", "quant": "int4_awq", "gates": FULL_KL, "tp_size": 2}
    )
    argv = fp4.serve_argv(fp4.serve_spec(ServeSpec()))
    assert argv[0] == "trtllm-serve" and argv[argv.index("--tp_size") + 1] == "2"
    # TensorRT-LLM's engine is built for its own size, 1 unless set
    trt = KINDS["trtllm"].model_validate(
        {"kind": "trtllm", "quant": "fp16", "gpu_arch": "sm90", "gates": FULL_KL}
    )
    assert trt.serve_spec(recipe_serve).tp_size == 1 and trt.model_dump()["tp_size"] == 1


@pytest.mark.parametrize(("mode", "number"), [("layer", 1), ("row", 2), ("tensor", 3)])
def test_a_gguf_over_several_gpus_gets_llama_cpp_servers_split_flags(mode: str, number: int) -> None:
    """llama-server takes `-sm` layer (whole layers per GPU), row (rows of each matrix) or tensor
    (llama.cpp's tensor parallelism) and `-ts` even shares over tp_size GPUs; at 1, none.
    Validation splits the same way: the worker's llama_cpp.Llama settings and its
    llama-perplexity flags. Every flag as this build's llama-server and llama-perplexity spell them."""
    gguf = KINDS["gguf"].model_validate({"kind": "gguf", "quant": "Q8_0", "gates": FULL_KL, "tp_size": 3})
    assert "-sm" not in gguf.serve_argv(ServeSpec())
    argv = gguf.serve_argv(gguf.serve_spec(ServeSpec(llamacpp={"split_mode": mode, "n_gpu_layers": -1})))
    assert argv[argv.index("-sm") + 1] == mode and argv[argv.index("-ts") + 1] == "1,1,1"
    assert argv[argv.index("-ngl") + 1] == "all" and "--kv-unified" not in argv  # a stream per slot
    unified = ServeSpec(llamacpp={"kv_unified": True})
    assert gguf.serve_argv(unified)[-1] == "--kv-unified"  # one KV cache the slots share
    assert "--cache-ram" not in argv  # llama.cpp's default prompt cache unless the recipe sets one
    no_cache = gguf.serve_argv(ServeSpec(llamacpp={"cache_ram_mib": 0}))
    assert no_cache[-2:] == ["--cache-ram", "0"]
    no_limit = gguf.serve_argv(ServeSpec(llamacpp={"cache_ram_mib": -1}))
    assert no_limit[-2:] == ["--cache-ram", "-1"]
    with pytest.raises(ValidationError, match="cache_ram_mib"):
        ServeSpec(llamacpp={"cache_ram_mib": -2})
    from pipeline.workers import llamacpp

    server = subprocess.run(
        [str(llamacpp.tool(argv[0])), "--help"], capture_output=True, text=True, check=False
    )
    for flag in ("-m,    --model FNAME", "-c,    --ctx-size N", "-np,   --parallel N", "-ngl,  --gpu-layers",
                 "-sm,   --split-mode {none,layer,row,tensor}", "-ts,   --tensor-split N0,N1,N2",
                 "--host HOST", "--port PORT", "-t,    --threads N",
                 "-kvu,  --kv-unified", "-cram, --cache-ram N"):  # fmt: skip
        assert flag in server.stdout + server.stderr, flag

    from pipeline.targets.gguf import split_request

    request = {
        "gguf_path": "m.gguf",
        "ctx": 128,
        **split_request(gguf.serve_spec(ServeSpec(llamacpp={"split_mode": mode}))),
    }
    assert llamacpp.split_settings(request) == {"split_mode": number, "tensor_split": [1.0, 1.0, 1.0]}
    command = llamacpp._perplexity(request)
    assert command[command.index("-sm") + 1] == mode and command[command.index("-ts") + 1] == "1,1,1"
    one = {"gguf_path": "m.gguf", "ctx": 128, **split_request(ServeSpec())}
    assert llamacpp.split_settings(one) == {} and "-sm" not in llamacpp._perplexity(one)
    usage = subprocess.run([command[0], "--help"], capture_output=True, text=True, check=False)
    assert "-sm,   --split-mode {none,layer,row,tensor}" in usage.stdout + usage.stderr
    assert "-ts,   --tensor-split N0,N1,N2" in usage.stdout + usage.stderr


def test_the_build_context_gives_each_target_its_own_serve_knobs(tmp_path: Path) -> None:
    """What validation, the serve check and the benchmark read (BuildContext.serve): the target's
    tp_size over the recipe's; the recipe's own knobs for a name that is not a target."""
    from pipeline.project import Project
    from tests.conftest import empty_checkpoint, write_recipe

    empty_checkpoint(tmp_path / "model")
    awq = {"kind": "awq", "gates": {"max_ppl_delta_pct": 10, "max_kld_topk_mean": 1}}
    recipe = write_recipe(
        tmp_path / "r.yaml", serve={"tp_size": 2}, targets={"wide": {**awq, "tp_size": 4}, "plain": awq}
    )
    ctx = Project.open(recipe).context()
    assert [ctx.serve(n).tp_size for n in ("wide", "plain", "not-a-target")] == [4, 2, 2]


def test_the_recipes_tp_size_shards_only_what_vllm_or_sglang_serve() -> None:
    """`serve.tp_size: 2` shards the vLLM/SGLang kinds; a GGUF and a trtllm-serve checkpoint stay
    on one GPU (their serve commands, and inputs hashes, as before) unless the target says."""
    two, one = ServeSpec(tp_size=2), ServeSpec()
    gguf = KINDS["gguf"].model_validate({"kind": "gguf", "quant": "Q8_0", "gates": FULL_KL})
    assert gguf.serve_spec(two).tp_size == 1
    assert gguf.serve_command(gguf.serve_spec(two)) == gguf.serve_command(one)
    int4_awq = KINDS["modelopt"].model_validate({"kind": "modelopt", "quant": "int4_awq", "gates": FULL_KL})
    assert "--tp_size" not in int4_awq.serve_argv(int4_awq.serve_spec(two))
    fp8 = KINDS["modelopt"].model_validate({"kind": "modelopt", "quant": "fp8", "gates": TOP_K_KL})
    argv = fp8.serve_argv(fp8.serve_spec(two))
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"


def test_engines_all_benchmarks_each_engine_that_passed_through_its_own_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serving_benchmark.engines: all` on an AWQ target: the vLLM command (the manifest's) and
    SGLang's own, the one its serve check runs; an engine whose verdict did not pass gets a skipped
    record naming that verdict, and the primary engine's result is unchanged by the other's. No
    engine starts here: the load generator's environment is missing, which is recorded too."""
    from pipeline.errors import EngineError
    from pipeline.manifest import EngineVerdict, Validation
    from pipeline.project import Project
    from pipeline.serving import benchmark
    from tests.conftest import empty_checkpoint, write_recipe

    empty_checkpoint(tmp_path / "model")
    awq = KINDS["awq"].model_validate({"kind": "awq", "gates": TOP_K_KL})
    others = awq.other_serve_argvs()
    assert list(others) == ["sglang"]
    assert command_line(others["sglang"](ServeSpec())) == command_line(
        sglang.serve_argv(ServeSpec(), awq.sglang_quantization, awq.dtype)
    )
    assert (
        KINDS["gguf"].model_validate({"kind": "gguf", "quant": "Q8_0", "gates": FULL_KL}).other_serve_argvs()
        == {}
    )
    monkeypatch.setenv("PIPELINE_GUIDELLM_PYTHON", str(tmp_path / "no-guidellm" / "python"))
    sglang_skipped = EngineVerdict(status="skipped", reason="no SGLang environment")
    validation = Validation(
        engine="vllm",
        status="passed",
        engines={"vllm": EngineVerdict(status="passed"), "sglang": sglang_skipped},
    )
    load = {"enabled": True, "concurrency": [1]}
    cases = (
        ("primary", ["vllm"]),
        (["sglang"], ["sglang"]),
        (["llama.cpp"], []),
        ("all", ["vllm", "sglang"]),
    )
    for index, (engines, expected) in enumerate(cases):
        recipe = write_recipe(tmp_path / f"{index}.yaml", serving_benchmark={**load, "engines": engines},
                              targets={"awq": {"kind": "awq", "gates": TOP_K_KL}})  # fmt: skip
        ctx = Project.open(recipe).context()
        got = benchmark(ctx, "awq", tmp_path / "model", validation, awq.serve_argv, other_argvs=others)
        assert list(got) == expected
        if "vllm" in got:
            assert got["vllm"].status == "skipped" and "no guidellm environment" in (got["vllm"].reason or "")
    assert got["sglang"].reason == "its sglang verdict is skipped: no SGLang environment"
    # both verdicts passed: each engine's own command, python and step log reach the load generator
    # (the step is recorded and refused here; SGLang is CUDA-only), and the bandwidth bound, which
    # reads the weights (a GGUF's through a recorded llama.cpp step), is never computed for a
    # benchmark that did not run
    monkeypatch.setenv("PIPELINE_GUIDELLM_PYTHON", sys.executable)
    (tmp_path / "model" / "tokenizer.json").write_text("{}")  # the load generator's (never read here)
    both = validation.model_copy(
        update={"engines": {e: EngineVerdict(status="passed") for e in ("vllm", "sglang")}}
    )
    asked: list[tuple[str, str, str]] = []

    def refuse(env: str, request: dict, log: str, timeout_s: float) -> dict:
        asked.append((request["python"], " ".join(request["argv"]), log))
        raise EngineError(f"{log}: not run here")

    reads: list[int] = []

    def weights_read() -> int:
        reads.append(1)
        return 1

    monkeypatch.setattr(ctx, "step", refuse)
    got = benchmark(ctx, "awq", tmp_path / "model", both, awq.serve_argv, weights_read=weights_read,
                    other_argvs=others)  # fmt: skip
    assert [(e, r.status, r.reason) for e, r in got.items()] == [
        ("vllm", "failed", "awq-bench: not run here"), ("sglang", "failed", "awq-sglang-bench: not run here"),
    ]  # fmt: skip
    (vllm_python, vllm_argv, _), (sglang_python, sglang_argv, _) = asked
    assert vllm_argv.startswith("python -m vllm.entrypoints.openai.api_server") and "vllm" in vllm_python
    assert sglang_argv.startswith("python -m sglang.launch_server") and "sglang" in sglang_python
    assert "--port" in sglang_argv and "127.0.0.1" in sglang_argv and not reads
    failed = validation.model_copy(
        update={"status": "failed", "engines": {"vllm": EngineVerdict(status="failed")}}
    )
    assert benchmark(ctx, "awq", tmp_path / "model", failed, awq.serve_argv, other_argvs=others) == {}


def test_another_engine_s_deploy_command_is_part_of_the_inputs(tmp_path: Path) -> None:
    """SGLang's serve check and benchmark run its deploy command, so its knobs make an AWQ target
    stale; a GGUF target, served by llama.cpp alone, keeps its hash when they change."""
    import numpy as np
    from safetensors.numpy import save_file

    from pipeline.project import Project, bytes_sha256, inputs_sha256
    from tests.conftest import empty_checkpoint, write_recipe

    source = empty_checkpoint(tmp_path / "model")
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(source / "model.safetensors"))
    targets = {"awq": {"kind": "awq", "gates": TOP_K_KL}, "gguf-q8_0": {"kind": "gguf", "quant": "Q8_0",
               "gates": FULL_KL}}  # fmt: skip

    def hashes(fraction: float) -> dict[str, str]:
        recipe = write_recipe(tmp_path / f"{fraction}.yaml", targets=targets,
                              serve={"sglang": {"mem_fraction_static": fraction}})  # fmt: skip
        project = Project.open(recipe)
        ctx = project.context()
        got: dict[str, str] = {}
        for name, spec in project.select(None).items():
            toolchain = {env: {} for env in spec.recorded_environments()}
            files_sha256 = bytes_sha256(ctx, name, spec, toolchain)
            serve_command = spec.serve_command(ctx.serve(name))
            got[name] = inputs_sha256(ctx, name, spec, toolchain, serve_command, files_sha256)
        return got

    before, after = hashes(0.8), hashes(0.7)
    assert after["awq"] != before["awq"]
    assert after["gguf-q8_0"] == before["gguf-q8_0"]


def test_a_deploy_commands_program_is_where_its_environments_toolchain_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BuildContext.program: `python` as it is, without asking (the worker runs its environment's
    interpreter); llama-server where the llama.cpp toolchain names it; a program no toolchain
    names, from the PATH."""
    from pipeline.context import BuildContext
    from pipeline.project import Project
    from tests.conftest import empty_checkpoint, write_recipe

    empty_checkpoint(tmp_path / "model")
    ctx = Project.open(write_recipe(tmp_path / "r.yaml")).context()
    asked: list[str] = []

    def toolchain(self: BuildContext, env: str) -> dict:
        asked.append(env)
        return {"toolchain": {}, "programs": {"llama-server": "/opt/llama.cpp/bin/llama-server"}}

    monkeypatch.setattr(BuildContext, "toolchain", toolchain)
    assert ctx.program("vllm", "python") == "python" and asked == []
    assert ctx.program("llamacpp", "llama-server") == "/opt/llama.cpp/bin/llama-server"
    assert ctx.program("trtllm", "trtllm-serve") == "trtllm-serve"
