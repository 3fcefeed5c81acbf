"""Recipe schema: shipped recipes load; every bad input is one RecipeError naming file, key, why."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.errors import RecipeError, RegistryError
from pipeline.project import Project
from pipeline.recipe import load_recipe
from pipeline.spec import level_requests
from pipeline.texts import parse_hf_ref
from tests.conftest import REPO, empty_checkpoint, write_recipe

F16 = {"kind": "gguf", "quant": "F16", "gates": {"max_ppl_delta_pct": 0.1, "max_kld_mean": 0.001}}


@pytest.mark.parametrize("name", ["smollm2-135m.yaml", "qwen2-7b.yaml"])
def test_shipped_recipes_load(name: str) -> None:
    path = REPO / "recipes" / name
    loaded = load_recipe(path)
    assert list(loaded.recipe.targets) == list(yaml.safe_load(path.read_text())["targets"])
    assert loaded.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_qwen_recipe_is_pinned_to_a_commit() -> None:
    recipe = load_recipe(REPO / "recipes" / "qwen2-7b.yaml").recipe
    assert recipe.source.repo == "Qwen/Qwen2-7B-Instruct"
    assert recipe.source.revision and len(recipe.source.revision) == 40
    # real corpora, pinned: wikitext-2 test for evaluation, a Pile sample for calibration
    evaluation, calibration = parse_hf_ref(recipe.evaluation.text), parse_hf_ref(recipe.calibration.dataset)
    assert evaluation.repo == "Salesforce/wikitext"
    assert (evaluation.config, evaluation.split) == ("wikitext-2-raw-v1", "test")
    assert calibration.repo == "NeelNanda/pile-10k" and calibration.split == "train"


def _error(tmp_path: Path, text: str | None = None, **overrides: object) -> str:
    path = tmp_path / "r.yaml"
    empty_checkpoint(tmp_path / "model")
    if text is None:
        write_recipe(path, **overrides)
    else:
        path.write_text(text)
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    message = str(exc.value)
    assert str(path) in message and "\n" not in message
    return message


def test_malformed_yaml(tmp_path: Path) -> None:
    assert "line 2: malformed YAML: mapping values" in _error(tmp_path, "name: x\nfoo: bar: baz\n")


def test_not_a_mapping(tmp_path: Path) -> None:
    assert "must be a YAML mapping" in _error(tmp_path, "- a\n- b\n")


def test_unknown_key(tmp_path: Path) -> None:
    assert "colour: unknown key" in _error(tmp_path, colour="red")


def test_the_serving_benchmark_names_only_the_recipes_targets(tmp_path: Path) -> None:
    bench = {"enabled": True, "targets": ["gguf-f16", "gguf-q9"]}
    assert "serving_benchmark.targets: ['gguf-q9'] are not targets of this recipe" in _error(
        tmp_path, serving_benchmark=bench
    )
    only_f16 = {**bench, "targets": ["gguf-f16"]}
    chosen = load_recipe(write_recipe(tmp_path / "r.yaml", serving_benchmark=only_f16))
    spec = chosen.recipe.serving_benchmark
    assert spec.benchmarks("gguf-f16") and not spec.benchmarks("gguf-q8_0")
    assert "targets" not in spec.workload() and "enabled" not in spec.workload()  # what manifests record
    every = load_recipe(write_recipe(tmp_path / "all.yaml", serving_benchmark={"enabled": True}))
    assert every.recipe.serving_benchmark.benchmarks("gguf-q8_0")
    off = load_recipe(write_recipe(tmp_path / "off.yaml", serving_benchmark={"targets": ["gguf-f16"]}))
    assert not off.recipe.serving_benchmark.benchmarks("gguf-f16")


def test_a_benchmarked_gguf_needs_llama_server_slots_that_hold_each_workload(tmp_path: Path) -> None:
    """llama-server splits `n_ctx` KV cells between its `parallel` slots, and a request longer than
    its slot is refused: a benchmark whose prompt + output would not fit is a recipe error, naming
    both knobs; a benchmark of no GGUF, or a shape that fits, loads."""
    bench = {"enabled": True, "prompt_tokens": 512, "output_tokens": 128,
             "more_workloads": [{"prompt_tokens": 2048, "output_tokens": 256}]}  # fmt: skip
    serve = {"llamacpp": {"n_ctx": 8192, "parallel": 8}}
    assert (
        "serving_benchmark: 2048/256 tokens do not fit a llama-server slot of 1024 "
        "(serve.llamacpp n_ctx 8192 over parallel 8)"
    ) in _error(tmp_path, serving_benchmark=bench, serve=serve)
    fits = {"llamacpp": {"n_ctx": 2560 * 8, "parallel": 8}}
    assert load_recipe(write_recipe(tmp_path / "fits.yaml", serving_benchmark=bench, serve=fits))
    awq = {"awq": {"kind": "awq", "gates": {"max_ppl_delta_pct": 5, "max_kld_topk_mean": 0.1}}}
    assert load_recipe(write_recipe(tmp_path / "awq.yaml", serving_benchmark=bench, serve=serve, targets=awq))
    edge = {"llamacpp": {"n_ctx": 2304 * 8, "parallel": 8}}  # 2048 + 256 and no token for a BOS
    assert "do not fit a llama-server slot of 2304" in _error(tmp_path, serving_benchmark=bench, serve=edge)
    sglang_only = {**bench, "engines": ["sglang"]}  # no GGUF is benchmarked through llama.cpp
    assert load_recipe(write_recipe(tmp_path / "sg.yaml", serving_benchmark=sglang_only, serve=serve))
    for n_ctx, parallel in ((64, 8), (4096 + 128, 4)):  # slots of 8 tokens; of 1056 (not 4 x 256 steps)
        assert (
            f"n_ctx {n_ctx} over {parallel} slots: llama.cpp sizes each slot in steps of 256 tokens"
        ) in _error(tmp_path, serve={"llamacpp": {"n_ctx": n_ctx, "parallel": parallel}})


def test_each_level_runs_whole_waves_of_its_concurrency() -> None:
    # at least `requests`, rounded up to a multiple of the level, and at least min_waves waves
    load = {"requests": 32, "concurrency": [1, 8, 32, 128], "min_waves": 4}
    assert level_requests(load) == [32, 32, 128, 512]
    assert level_requests({**load, "min_waves": 1}) == [32, 32, 32, 128]
    assert level_requests({"requests": 8, "concurrency": [1, 3, 4]}) == [8, 9, 8]  # recipes before min_waves


def test_more_workloads_run_after_the_first_and_only_they_move_the_inputs_hash(tmp_path: Path) -> None:
    empty_checkpoint(tmp_path / "model")
    first = {"enabled": True, "prompt_tokens": 512, "output_tokens": 128, "concurrency": [8, 1]}
    one = load_recipe(write_recipe(tmp_path / "one.yaml", serving_benchmark=first)).recipe.serving_benchmark
    # a recipe without further shapes hashes what it hashed before they existed
    assert one.hashed() == {
        "enabled": True, "prompt_tokens": 512, "output_tokens": 128, "concurrency": [1, 8], "requests": 8,
        "max_seconds_per_level": 120.0, "seed": 0,
    }  # fmt: skip
    assert one.workloads() == [one.workload()]
    more = {**first, "more_workloads": [{"prompt_tokens": 2048, "output_tokens": 256}]}
    slots = {"llamacpp": {"n_ctx": 4 * 2560}}  # four llama-server slots that hold 2048 + 256
    two_path = write_recipe(tmp_path / "two.yaml", serving_benchmark=more, serve=slots)
    two = load_recipe(two_path).recipe.serving_benchmark
    assert two.workload() == one.workload()  # the first, as the manifest's `workload` records it
    second = two.workloads()[1]
    assert (second["prompt_tokens"], second["output_tokens"], second["concurrency"]) == (2048, 256, [1, 8])
    assert two.hashed() != one.hashed()
    waves = {**first, "min_waves": 4}  # set, it moves the hash; left at 1, it is not hashed (above)
    four = load_recipe(write_recipe(tmp_path / "four.yaml", serving_benchmark=waves)).recipe.serving_benchmark
    assert four.hashed() == {**one.hashed(), "min_waves": 4}
    every = {**first, "engines": "all"}  # each engine with a passing verdict: it moves the hash
    both = load_recipe(write_recipe(tmp_path / "both.yaml", serving_benchmark=every)).recipe.serving_benchmark
    assert both.hashed() == {**one.hashed(), "engines": "all"} and both.workload() == one.workload()
    named = {**first, "engines": ["sglang"]}  # the engines named, of those serving a target
    one_engine = load_recipe(write_recipe(tmp_path / "named.yaml", serving_benchmark=named)).recipe
    assert one_engine.serving_benchmark.hashed() == {**one.hashed(), "engines": ["sglang"]}
    assert one_engine.serving_benchmark.engines_of("vllm", ["sglang"]) == ["sglang"]
    assert one_engine.serving_benchmark.engines_of("llama.cpp", []) == []
    assert both.engines_of("vllm", ["sglang"]) == ["vllm", "sglang"] and one.engines_of(
        "vllm", ["sglang"]
    ) == ["vllm"]
    assert (
        "serving_benchmark.engines: engines is primary, all or a list of distinct engine names of "
        "['llama.cpp', 'sglang', 'tensorrt-llm', 'vllm'], not 'sgl'"
        in _error(tmp_path, serving_benchmark={**first, "engines": ["sgl"]})
    )
    assert "serving_benchmark.engines" in _error(tmp_path, serving_benchmark={**first, "engines": []})
    for bare in ("every", "sglang"):  # a list is meant
        assert f"a list of engine names such as [sglang], not {bare!r}" in _error(
            tmp_path, serving_benchmark={**first, "engines": bare}
        )
    for odd in (["vllm", "vllm"], [{"vllm": 1}], 3):
        assert "engine names" in _error(tmp_path, serving_benchmark={**first, "engines": odd})
    again = {**first, "more_workloads": [{"prompt_tokens": 512, "output_tokens": 128}]}
    assert "more_workloads repeats the shape (prompt, output) (512, 128)" in _error(
        tmp_path, serving_benchmark=again
    )
    assert "more_workloads.0.output_tokens: Field required" in _error(
        tmp_path, serving_benchmark={**first, "more_workloads": [{"prompt_tokens": 64}]}
    )


def test_a_serve_host_that_is_not_an_address_or_a_hostname_is_refused(tmp_path: Path) -> None:
    msg = _error(tmp_path, serve={"host": "127.0.0.1; touch /tmp/x/pwned #"})
    assert "serve.host: '127.0.0.1; touch /tmp/x/pwned #' is neither an IP address nor a hostname" in msg
    assert "neither an IP" in _error(tmp_path, serve={"host": "-leading-dash"})


@pytest.mark.parametrize("host", ["0.0.0.0", "::1", "localhost", "node-1.build.internal"])
def test_addresses_and_hostnames_reach_every_serve_command(tmp_path: Path, host: str) -> None:
    empty_checkpoint(tmp_path / "model")
    targets = {
        "f16": F16,
        "awq": {"kind": "awq", "gates": {"max_ppl_delta_pct": 30, "max_kld_topk_mean": 0.3}},
    }
    loaded = load_recipe(write_recipe(tmp_path / "r.yaml", serve={"host": host}, targets=targets))
    for target in loaded.recipe.targets.values():
        assert f" --host {host} " in target.serve_command(loaded.recipe.serve)


def test_unknown_key_inside_target(tmp_path: Path) -> None:
    msg = _error(tmp_path, targets={"a": {**F16, "bits": 4}})
    assert "target 'a'" in msg and "bits: unknown key" in msg


def test_unknown_target_kind(tmp_path: Path) -> None:
    msg = _error(tmp_path, targets={"a": {"kind": "onnx"}})
    assert "unknown kind 'onnx'" in msg and "gguf, awq, gptq" in msg


def test_bad_quant_name(tmp_path: Path) -> None:
    msg = _error(tmp_path, targets={"a": {**F16, "quant": "Q3_Z"}})
    assert "quant: unknown GGUF quant 'Q3_Z'" in msg


def test_imatrix_on_unquantized_type(tmp_path: Path) -> None:
    assert "imatrix only applies to quantized types" in _error(
        tmp_path, targets={"a": {**F16, "imatrix": True}}
    )


def test_imatrix_needs_calibration(tmp_path: Path) -> None:
    t = {"a": {**F16, "quant": "IQ4_XS", "imatrix": True}}
    assert "need a `calibration` section" in _error(tmp_path, targets=t, calibration=None)


def test_calibration_is_not_evaluation_text(tmp_path: Path) -> None:
    msg = _error(tmp_path, calibration={"dataset": "builtin:apache-2.0"})
    assert "must not be the evaluation text" in msg


def test_missing_source(tmp_path: Path) -> None:
    assert "source: give exactly one of repo, path, package" in _error(tmp_path, source={})


def test_missing_source_dir(tmp_path: Path) -> None:
    assert "directory 'nowhere' not found" in _error(tmp_path, source={"path": "nowhere"})


def test_a_source_dir_without_config_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bare").mkdir()
    assert "source.path: 'bare' has no config.json (not a Hugging Face checkpoint)" in _error(
        tmp_path, source={"path": "bare"}
    )


def test_hub_repo_must_be_pinned(tmp_path: Path) -> None:
    msg = _error(tmp_path, source={"repo": "Qwen/Qwen2-7B-Instruct", "revision": "main"})
    assert "pinned to a 40-hex commit" in msg


def test_missing_gates(tmp_path: Path) -> None:
    assert "gates: Field required" in _error(tmp_path, targets={"a": {"kind": "gguf", "quant": "Q8_0"}})


def test_missing_calibration_file(tmp_path: Path) -> None:
    assert "file 'cal.txt' not found" in _error(tmp_path, calibration={"dataset": "cal.txt"})


def test_select_unknown_target(tmp_path: Path) -> None:
    empty_checkpoint(tmp_path / "model")
    project = Project.open(write_recipe(tmp_path / "r.yaml"), root=tmp_path / "artifacts")
    with pytest.raises(RecipeError, match="unknown target"):
        project.select(["nope"])


def test_every_error_of_a_recipe_is_reported_at_once(tmp_path: Path) -> None:
    """An unknown kind in one target is not hidden behind another target's bad value, and the
    file and model checks that run after parsing report together too."""
    msg = _error(tmp_path, targets={"a": {**F16, "quant": "Q9_9"}, "b": {"kind": "warp-drive"}})
    assert "target 'a': quant: unknown GGUF quant 'Q9_9'" in msg
    assert "target 'b': unknown kind 'warp-drive'" in msg
    (tmp_path / "model" / "config.json").write_text('{"hidden_size": 96, "intermediate_size": 256}')
    msg = _error(
        tmp_path,
        calibration={"dataset": "missing.txt"},
        targets={"gptq": {"kind": "gptq", "group_size": 64, **INT4}, "awq": {"kind": "awq", **INT4}},
    )
    assert "calibration.dataset: file 'missing.txt' not found" in msg
    assert "targets.gptq.group_size: 64 does not divide" in msg
    assert "targets.awq.group_size: 128 does not divide" in msg
    res = CliRunner().invoke(app, ["recipe", "check", str(tmp_path / "r.yaml")])
    assert (
        res.exit_code == RecipeError.exit_code
        and "targets.gptq" in res.output
        and "targets.awq" in res.output
    )


def test_kld_gates_name_what_the_engines_measure(tmp_path: Path) -> None:
    """vLLM/SGLang report a top-k lower bound of the KL; llama.cpp a full-vocabulary KL: a gate on
    the wrong one is refused, and the right one is required."""
    full_gate = {"max_ppl_delta_pct": 30.0, "max_kld_mean": 0.3}
    msg = _error(tmp_path, targets={"awq": {"kind": "awq", "group_size": 64, "gates": full_gate}})
    assert "gates.max_kld_mean: the serving engines (vllm, sglang) report kld_topk_mean" in msg
    assert "use max_kld_topk_mean" in msg
    msg = _error(tmp_path, targets={"a": {**F16, "gates": {"max_ppl_delta_pct": 1, "max_kld_topk_mean": 1}}})
    assert "gates.max_kld_mean: required, llama.cpp reports kld_mean" in msg


def test_cli_recipe_check(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["recipe", "check", str(REPO / "recipes" / "smollm2-135m.yaml")])
    assert ok.exit_code == 0 and "ok:" in ok.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [\n")
    res = runner.invoke(app, ["recipe", "check", str(bad)])
    assert res.exit_code == RecipeError.exit_code
    assert "malformed YAML" in res.output


def test_cli_build_unknown_target_exits_nonzero() -> None:
    res = CliRunner().invoke(
        app, ["build", str(REPO / "recipes" / "smollm2-135m.yaml"), "--targets", "nope", "--dry-run"]
    )
    assert res.exit_code == RecipeError.exit_code
    assert "unknown target(s) nope" in res.output


@pytest.mark.parametrize("targets", [",", "", "gguf-f16,,awq"])
def test_cli_build_targets_naming_no_target_is_an_error(targets: str) -> None:
    res = CliRunner().invoke(
        app, ["build", str(REPO / "recipes" / "smollm2-135m.yaml"), "--targets", targets, "--dry-run"]
    )
    assert res.exit_code == RecipeError.exit_code
    assert "an empty target name (leave --targets out for all)" in res.output


@pytest.mark.parametrize("artifact", ["../../x", "smollm2-135m/../../etc", "/etc/passwd", "one"])
def test_cli_show_reads_only_recipe_slash_target(artifact: str, _isolated_artifacts: Path) -> None:
    res = CliRunner().invoke(app, ["show", artifact])
    assert res.exit_code == RegistryError.exit_code
    assert "expected RECIPE/TARGET (lowercase names, no path)" in res.output


def test_cli_dry_run_plans_without_building(_isolated_artifacts: Path) -> None:
    res = CliRunner().invoke(app, ["build", str(REPO / "recipes" / "smollm2-135m.yaml"), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "planned" in res.output
    assert not _isolated_artifacts.exists()


INT4 = {"gates": {"max_ppl_delta_pct": 30.0, "max_kld_topk_mean": 0.3}}


def test_int4_targets_parse(tmp_path: Path) -> None:
    empty_checkpoint(tmp_path / "model")
    targets = {
        "awq": {"kind": "awq", "group_size": 64, **INT4},
        "gptq": {"kind": "gptq", "group_size": 64, **INT4},
    }
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", targets=targets)).recipe
    assert recipe.targets["awq"].symmetric is False and recipe.targets["gptq"].symmetric is True


def test_a_backend_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    gptq = {"kind": "gptq", "group_size": 64, "backend": "gptqmodel", "ignore": ["lm_head", "mlp"], **INT4}
    assert "backend gptqmodel keeps only lm_head unquantized" in _error(tmp_path, targets={"gptq": gptq})
    unknown = {**gptq, "ignore": ["lm_head"], "backend": "autogptq"}
    message = _error(tmp_path, targets={"gptq": unknown})
    assert "backend: Input should be 'llm-compressor' or 'gptqmodel'" in message


def test_group_size_must_divide_the_models_layers() -> None:
    """SmolLM2's hidden size is 576: group 128 is refused at recipe time, naming the fix."""
    text = (
        (REPO / "recipes" / "smollm2-135m.yaml").read_text().replace("group_size: 64", "group_size: 128", 1)
    )
    path = REPO / "tests" / ".tmp-bad-group.yaml"  # beside the real recipe: same relative paths
    path.write_text(text)
    try:
        with pytest.raises(RecipeError) as exc:
            load_recipe(path)
    finally:
        path.unlink()
    assert "targets.awq.group_size: 128 does not divide" in str(exc.value)
    assert "hidden_size 576" in str(exc.value) and "use 64" in str(exc.value)


def test_group_size_checked_against_a_local_checkpoint(tmp_path: Path) -> None:
    empty_checkpoint(tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text('{"hidden_size": 96, "intermediate_size": 256}')
    msg = _error(tmp_path, targets={"gptq": {"kind": "gptq", "group_size": 64, **INT4}})
    assert "targets.gptq.group_size: 64 does not divide" in msg and "use 32" in msg


def test_unsupported_group_size_and_act_order(tmp_path: Path) -> None:
    assert "group_size: Input should be -1, 32, 64 or 128" in _error(
        tmp_path, targets={"a": {"kind": "awq", "group_size": 48, **INT4}}
    )
    assert "n_grid: Input should be greater than or equal to 3" in _error(
        tmp_path, targets={"a": {"kind": "awq", "n_grid": 2, **INT4}}
    )
    assert "act_order: Input should be 'static' or 'weight'" in _error(
        tmp_path, targets={"g": {"kind": "gptq", "act_order": "group", **INT4}}
    )


def test_empty_calibration_file(tmp_path: Path) -> None:
    (tmp_path / "cal.txt").write_text("")
    msg = _error(tmp_path, calibration={"dataset": "cal.txt"}, targets={"a": {"kind": "awq", **INT4}})
    assert "calibration.dataset: file 'cal.txt' is empty" in msg


def test_the_engine_table_covers_every_kind_and_names_real_environments() -> None:
    """One table of serving engines (pipeline.constants.ENGINES): every kind's primary engine is in
    it, each entry runs in an environment of the environment table and measures a gated KL."""
    from pipeline.constants import ENGINES, KLD_GATES
    from pipeline.environments import ENVIRONMENTS
    from pipeline.spec import KINDS

    assert {cls.engine for cls in KINDS.values()} <= ENGINES.keys()
    for name, engine in ENGINES.items():
        assert engine.name == name and engine.env in ENVIRONMENTS and engine.version_dists
        assert engine.kld_metric in KLD_GATES
