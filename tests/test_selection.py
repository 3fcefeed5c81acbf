"""`pipeline registry select`: scenarios answered from the numbers in the manifests, with reasons."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pipeline.artifacts import file_entries
from pipeline.cli import app
from pipeline.decode_bound import decode_bound
from pipeline.errors import RegistryError
from pipeline.manifest import (
    DecodeBound,
    Metrics,
    ServingLevel,
    ServingResult,
    StepRecord,
    WorkloadRun,
    read_manifest,
    write_manifest,
)
from pipeline.registry import Registry
from pipeline.selection import Scenario, select
from tests.conftest import write_artifact

ROOT = Path(__file__).resolve().parent.parent


def _level(concurrency: int, ttft: float, itl: float, tps: float, rss: float | None = 900) -> ServingLevel:
    return ServingLevel(
        concurrency=concurrency, completed=8, errored=0, ttft_ms_p50=ttft / 2, ttft_ms_p99=ttft,
        itl_ms_p50=itl / 2, itl_ms_p99=itl, output_tokens_per_s=tps, requests_per_s=tps / 32,
        peak_rss_mib=rss,
    )  # fmt: skip


def _measured(
    root: Path,
    target: str,
    engine: str,
    ppl_delta: float,
    device: str | None = None,
    gpu_arch: str | None = None,
    levels: list[ServingLevel] | None = None,
    validate_rss_mib: float | None = None,
    served_on: tuple[str, str | None] | None = None,  # the serving benchmark's (device, gpu_arch)
    bound: DecodeBound | None = None,
) -> Path:
    """A synthetic artifact of model m whose primary verdict passed with these numbers."""
    d = write_artifact(root, "m", target, engine, target.split("-")[-1], gpu_arch=gpu_arch)
    manifest = read_manifest(d)
    verdict = manifest.validation.engines[engine]
    verdict.metrics = Metrics(
        ppl=10 * (1 + ppl_delta / 100), ppl_ref=10.0, ppl_delta_pct=ppl_delta, top1_agreement=0.9,
        token_agreement=0.5, tokens_per_s=None, prompt_tokens_per_s=None, eval_tokens=1024,
    )  # fmt: skip
    if device:
        verdict.details = {"device": device}
    manifest.validation.metrics = verdict.metrics
    if levels is not None:
        manifest.serving = {
            engine: ServingResult(
                status="passed",
                tool="t",
                levels={str(lv.concurrency): lv for lv in levels},
                device=served_on[0] if served_on else None,
                gpu_arch=served_on[1] if served_on else None,
                decode_bound=bound,
                workload={"prompt_tokens": 512, "output_tokens": 128} if served_on else {},
            )
        }
    if validate_rss_mib is not None:
        env = {"llama.cpp": "llamacpp", "vllm": "vllm"}[engine]
        manifest.build.steps = [
            StepRecord(env=env, op="validate", log=target, seconds=1, peak_rss_mib=validate_rss_mib)
        ]
    manifest.files = file_entries(d)
    write_manifest(d, manifest)
    return d


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    root = tmp_path / "artifacts"
    _measured(root, "gguf-q8_0", "llama.cpp", 0.5, levels=[_level(1, 100, 50, 20), _level(4, 400, 120, 50)],
              validate_rss_mib=1400)  # fmt: skip
    _measured(root, "gguf-q4_0", "llama.cpp", 20.0, levels=[_level(1, 60, 30, 35, rss=None)])
    _measured(root, "awq", "vllm", 15.0, device="NVIDIA H200")
    _measured(root, "trtllm-fp8", "tensorrt-llm", 2.0, device="NVIDIA H200", gpu_arch="sm90")
    write_artifact(root, "m", "gptq", "vllm", "gptq", status="failed")
    reg = Registry(root)
    reg.rebuild()
    return reg


def _names(items: list[dict[str, Any]]) -> list[str]:
    return [f"{c['target']}@{c['engine']}" for c in items]


def _why(answer: dict[str, Any], target: str) -> str:
    return next(c["excluded"] for c in answer["excluded"] if c["target"] == target)


def test_most_accurate_on_a_cpu_host(registry: Registry) -> None:
    answer = select(registry, Scenario(model="m", cpu=True))
    assert _names(answer["ranked"]) == ["gguf-q8_0@llama.cpp", "gguf-q4_0@llama.cpp"]
    assert _why(answer, "awq") == "validated on NVIDIA H200, not on a CPU"
    assert _why(answer, "gptq") == "its vllm verdict is failed"
    best = answer["ranked"][0]
    assert best["memory_mib"] == 900.0 and best["memory_from"] == "serving benchmark peak RSS"
    assert any("ΔPPL +0.50 %" in r for r in best["reasons"])


def test_accuracy_and_memory_bounds_exclude_with_the_measured_number(registry: Registry) -> None:
    answer = select(registry, Scenario(model="m", cpu=True, max_ppl_delta=10))
    assert _names(answer["ranked"]) == ["gguf-q8_0@llama.cpp"]
    assert _why(answer, "gguf-q4_0") == "ΔPPL +20.00 % > 10 %"
    tight = select(registry, Scenario(model="m", cpu=True, memory_gib=0.5))
    assert _names(tight["ranked"]) == ["gguf-q4_0@llama.cpp"]
    assert tight["ranked"][0]["memory_from"].startswith("weights' size (a lower bound")
    assert _why(tight, "gguf-q8_0") == "needs 900 MiB (serving benchmark peak RSS) > 0.5 GiB"


def test_latency_scenarios_read_the_serving_numbers_at_the_asked_concurrency(registry: Registry) -> None:
    fastest = select(registry, Scenario(model="m", cpu=True, objective="latency"))
    assert _names(fastest["ranked"]) == ["gguf-q4_0@llama.cpp", "gguf-q8_0@llama.cpp"]
    busy = select(registry, Scenario(model="m", cpu=True, max_ttft_ms=200, concurrency=4))
    assert busy["ranked"] == []
    assert _why(busy, "gguf-q8_0") == "TTFT p99 400 ms > 200 ms at concurrency 4"
    assert _why(busy, "gguf-q4_0") == "no serving numbers at concurrency 4 (measured at concurrency 1 only)"
    throughput = select(registry, Scenario(model="m", objective="throughput"))
    assert _names(throughput["ranked"]) == ["gguf-q4_0@llama.cpp", "gguf-q8_0@llama.cpp"]
    assert _why(throughput, "awq").startswith("no serving numbers at concurrency 1 (the serving benchmark")


def test_a_gpu_host_excludes_engines_built_for_another_architecture(registry: Registry) -> None:
    answer = select(registry, Scenario(model="m", gpu_arch="sm80"))
    assert _names(answer["ranked"])[0] == "gguf-q8_0@llama.cpp"
    assert "awq@vllm" in _names(answer["ranked"])
    assert _why(answer, "trtllm-fp8") == "built for sm90, not sm80"
    on_h200 = select(registry, Scenario(model="m", gpu_arch="sm90", max_ppl_delta=5))
    assert _names(on_h200["ranked"]) == ["gguf-q8_0@llama.cpp", "trtllm-fp8@tensorrt-llm"]


def test_bad_questions_are_one_line_errors(registry: Registry) -> None:
    with pytest.raises(RegistryError, match="exclude each other"):
        select(registry, Scenario(cpu=True, gpu_arch="sm90"))
    with pytest.raises(RegistryError, match="unknown objective 'cheap'"):
        select(registry, Scenario(objective="cheap"))  # type: ignore[arg-type]
    with pytest.raises(RegistryError, match="no validated artifact of model other"):
        select(registry, Scenario(model="other"))


def test_select_cli(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_ARTIFACTS", str(registry.root))
    runner = CliRunner()
    res = runner.invoke(app, ["registry", "select", "--model", "m", "--cpu", "--json"])
    assert res.exit_code == 0, res.output
    assert _names(json.loads(res.output)["ranked"])[0] == "gguf-q8_0@llama.cpp"
    res = runner.invoke(app, ["registry", "select", "--cpu", "--max-ppl-delta", "0.1"])
    assert res.exit_code == 1
    assert "no artifact fits this scenario" in res.output and "ΔPPL +0.50 % > 0.1 %" in res.output
    res = runner.invoke(app, ["registry", "select", "--cpu", "--gpu-arch", "sm90"])
    assert res.exit_code != 0 and "exclude each other" in res.output


def test_a_contended_benchmark_is_named_in_the_reasons(tmp_path: Path) -> None:
    """TTFT measured while another build ran is not a latency anyone can get: `select` says so."""
    root = tmp_path / "artifacts"
    busy = _level(1, 6600, 50, 2.1).model_copy(update={"others_cpu_share": 0.8})
    _measured(root, "gguf-q8_0", "llama.cpp", 0.5, levels=[busy])
    _measured(
        root,
        "gguf-q4_0",
        "llama.cpp",
        20.0,
        levels=[_level(1, 60, 30, 35).model_copy(update={"others_cpu_share": 0.05})],
    )
    reg = Registry(root)
    reg.rebuild()
    answer = select(reg, Scenario(model="m", cpu=True, objective="latency", concurrency=1))
    reasons = {c["target"]: " ".join(c["reasons"]) for c in answer["ranked"]}
    assert "CONTENDED: other processes used 80% of the host's CPUs" in reasons["gguf-q8_0"]
    assert "CONTENDED" not in reasons["gguf-q4_0"]


@pytest.mark.parametrize("all_streamed", [True, False])
def test_cut_levels_rank_by_what_they_streamed_where_every_one_recorded_it(
    tmp_path: Path, all_streamed: bool
) -> None:
    """Two levels cut by the cap (2026-12-07, H100: 221-233 of 512 requests finished at 128 streams):
    the one that finished more tokens may have streamed fewer. Where both recorded what they streamed,
    that ranks them; where one did not (a record from before), the finished tokens do."""
    root = tmp_path / "artifacts"
    more_finished = _level(128, 900, 40, 500.0).model_copy(
        update={"planned": 512, "incomplete": 128, "streamed_tokens_per_s": 600.0 if all_streamed else None}
    )
    more_streamed = _level(128, 900, 40, 450.0).model_copy(
        update={"planned": 512, "incomplete": 128, "streamed_tokens_per_s": 700.0}
    )
    _measured(root, "gguf-q4_0", "llama.cpp", 1.0, levels=[more_finished])
    _measured(root, "gguf-q8_0", "llama.cpp", 1.0, levels=[more_streamed])
    reg = Registry(root)
    reg.rebuild()
    answer = select(reg, Scenario(model="m", cpu=True, objective="throughput", concurrency=128))
    order = [c["target"] for c in answer["ranked"]]
    assert order == (["gguf-q8_0", "gguf-q4_0"] if all_streamed else ["gguf-q4_0", "gguf-q8_0"])
    named = "ranked among the cut levels by what each streamed inside its cap"
    assert all((named in c["reasons"]) == all_streamed for c in answer["ranked"])


def test_a_level_its_time_cap_cut_is_named_in_the_reasons(tmp_path: Path) -> None:
    """A level cut mid-wave counts only the finished requests' tokens over the whole window: a
    throughput nobody gets (2026-12-05, H200: 128 of 256 requests cut at 2048/256 tokens)."""
    root = tmp_path / "artifacts"
    cut = _level(1, 6, 3, 350).model_copy(
        update={"planned": 32, "incomplete": 1, "streamed_tokens_per_s": 9.5}
    )
    _measured(root, "gguf-q8_0", "llama.cpp", 0.5, levels=[cut])
    whole = _level(1, 60, 30, 35).model_copy(update={"planned": 32, "incomplete": 0})
    _measured(root, "gguf-q4_0", "llama.cpp", 20.0, levels=[whole])
    # none finished (2026-12-06, H100: 128 llama-server slots at 2048/256): no latency, no tokens
    none = ServingLevel(
        concurrency=1, completed=0, errored=0, planned=32, incomplete=32, output_tokens_per_s=0.0
    )
    _measured(root, "gguf-iq4_xs", "llama.cpp", 1.0, levels=[none])
    reg = Registry(root)
    reg.rebuild()
    for objective in ("throughput", "latency"):  # faster on paper, and still ranked after the whole one
        answer = select(reg, Scenario(model="m", cpu=True, objective=objective, concurrency=1))
        order = [c["target"] for c in answer["ranked"]]
        assert order == ["gguf-q4_0", "gguf-q8_0", "gguf-iq4_xs"], objective  # none finished: last
    reasons = {c["target"]: " ".join(c["reasons"]) for c in answer["ranked"]}
    assert "CUT: the level's time cap ended it with 8 of 32 requests finished" in reasons["gguf-q8_0"]
    assert "the server streamed 9.5 tokens/s inside it, cut requests included" in reasons["gguf-q8_0"]
    assert "CUT" not in reasons["gguf-q4_0"]
    assert "0.0 output tokens/s, no request finished" in reasons["gguf-iq4_xs"]
    assert "CUT: the level's time cap ended it with 0 of 32 requests finished" in reasons["gguf-iq4_xs"]
    bounded = select(reg, Scenario(model="m", cpu=True, objective="latency", concurrency=1, max_ttft_ms=5000))
    assert [c["target"] for c in bounded["ranked"]] == ["gguf-q4_0", "gguf-q8_0"]
    assert _why(bounded, "gguf-iq4_xs") == (
        "no request finished at concurrency 1 inside its time cap: no latency to bound"
    )


def test_workload_picks_which_shape_s_numbers_rank(tmp_path: Path) -> None:
    """`--workload 2048/256` reads the recipe's further workload (2026-12-05, H200: every artifact
    served 512/128 and then 2048/256 on the same server); an artifact without it is excluded."""
    root = tmp_path / "artifacts"
    h200 = ("NVIDIA H200", "sm90")
    long_shape = {"prompt_tokens": 2048, "output_tokens": 256}
    for target, short_tps, long_tps in (("awq", 4000.0, 900.0), ("gptq", 3000.0, 1500.0), ("fp8", 3500.0, 0)):
        levels = [_level(32, 50, 8, short_tps)]
        d = _measured(root, target, "vllm", 1.0, device="NVIDIA H200", levels=levels, served_on=h200)
        if long_tps:
            manifest = read_manifest(d)
            more = WorkloadRun(workload=long_shape, levels={"32": _level(32, 400, 20, long_tps)})
            manifest.serving["vllm"].more_workloads = [more]
            write_manifest(d, manifest)
    reg = Registry(root)
    reg.rebuild()
    first = select(reg, Scenario(model="m", gpu_arch="sm90", objective="throughput", concurrency=32))
    assert _names(first["ranked"]) == ["awq@vllm", "fp8@vllm", "gptq@vllm"]
    for spelling in ("2048/256", "2048x256"):
        asked = Scenario(gpu_arch="sm90", objective="throughput", concurrency=32, workload=spelling)
        long = select(reg, asked)
        assert _names(long["ranked"]) == ["gptq@vllm", "awq@vllm"]
        assert "at concurrency 32 of 2048/256 tokens on NVIDIA H200: 1500.0 output tokens/s" in " ".join(
            long["ranked"][0]["reasons"]
        )
        assert long["excluded"][0]["target"] == "fp8"
        assert "measured at 512/128 tokens, not 2048/256" in long["excluded"][0]["excluded"]
    with pytest.raises(RegistryError, match="--workload '2048': expected PROMPT/OUTPUT tokens"):
        select(reg, Scenario(model="m", workload="2048"))
    argv = ["registry", "select", "--gpu-arch", "sm90", "--objective", "throughput", "--concurrency", "32"]
    res = CliRunner().invoke(app, [*argv, "--workload", "2048/256"], env={"PIPELINE_ARTIFACTS": str(root)})
    assert res.exit_code == 0, res.output
    assert res.output.startswith("1. m/gptq v1 in vllm")
    # a record from before workloads were kept names none: said so, not "measured at no tokens"
    fp8 = next(d for d in root.rglob("manifest.json") if d.parent.name.startswith("fp8")).parent
    manifest = read_manifest(fp8)
    manifest.serving["vllm"].workload = {}
    write_manifest(fp8, manifest)
    reg.rebuild()
    old = select(reg, Scenario(gpu_arch="sm90", objective="throughput", concurrency=32, workload="2048/256"))
    assert "not run: its serving record names no workload, not 2048/256)" in old["excluded"][0]["excluded"]


def test_a_host_with_fewer_gpus_excludes_what_is_sharded_over_more(
    registry: Registry, tmp_path: Path
) -> None:
    """A deploy host's GPU count (`--gpus`): an artifact whose serve command shards it over more GPUs
    (`serve.tp_size`, recorded as the manifest's `serve.tp_size`) is excluded and never resolves."""
    d = registry.root / "m" / "awq"
    manifest = read_manifest(d)
    manifest.serve.tp_size = 2
    write_manifest(d, manifest)
    registry.rebuild()
    one = select(registry, Scenario(model="m", gpu_arch="sm90", gpus=1))
    assert _why(one, "awq") == "sharded over 2 GPUs (tp_size), the host has 1"
    assert "awq@vllm" in _names(select(registry, Scenario(model="m", gpu_arch="sm90", gpus=2))["ranked"])
    with pytest.raises(
        RegistryError, match=r"gpus=1: the matching artifacts are sharded over more GPUs: m/awq \(tp_size 2\)"
    ):
        registry.resolve("m", "vllm", "awq", gpus=1)
    assert registry.resolve("m", "vllm", "awq", gpus=2)["target"] == "awq"


def test_a_gpu_host_ranks_by_numbers_measured_on_its_architecture(tmp_path: Path) -> None:
    """Serving numbers count only where they were measured on the kind of host asked about: a CPU
    host's tokens/s say nothing of an H200's, and the other way round. Concurrency 1's share of the
    bandwidth bound is among the reasons."""
    root = tmp_path / "artifacts"
    _measured(root, "gguf-q4_0", "llama.cpp", 1.0, levels=[_level(1, 50, 10, 90)])  # a CPU host's
    w4 = decode_bound(4_500_000_000, 57_344, 640, "NVIDIA H200", tokens_per_s_c1=200.0)
    _measured(root, "awq", "vllm", 2.0, device="NVIDIA H200", levels=[_level(1, 30, 5, 200)],
              served_on=("NVIDIA H200", "sm90"), bound=w4)  # fmt: skip
    _measured(root, "gptq", "vllm", 1.5, device="NVIDIA H200", levels=[_level(1, 30, 5, 260)],
              served_on=("NVIDIA H100 80GB HBM3", "sm90"))  # fmt: skip
    _measured(root, "fp8", "vllm", 0.5, device="NVIDIA A100-SXM4-80GB", levels=[_level(1, 20, 4, 900)],
              served_on=("NVIDIA A100-SXM4-80GB", "sm80"))  # fmt: skip
    reg = Registry(root)
    reg.rebuild()
    answer = select(reg, Scenario(model="m", gpu_arch="sm90", objective="throughput"))
    assert _names(answer["ranked"]) == ["gptq@vllm", "awq@vllm"]
    assert _why(answer, "gguf-q4_0") == (
        "no serving numbers at concurrency 1 (its serving numbers were measured on cpu, not on sm90)"
    )
    assert _why(answer, "fp8") == (
        "no serving numbers at concurrency 1 "
        "(its serving numbers were measured on NVIDIA A100-SXM4-80GB (sm80), not on sm90)"
    )
    awq = next(c for c in answer["ranked"] if c["target"] == "awq")
    assert any(
        r.startswith("at concurrency 1 of 512/128 tokens on NVIDIA H200: 200.0 output tokens/s")
        for r in awq["reasons"]
    )
    assert any(r.startswith("19% of its 1058 tokens/s bandwidth bound (below 30%") for r in awq["reasons"])
    # on a GPU the peak is the engine's reservation: what it needs is weights + KV of the requests
    kv_mib = 57_344 * 640 / 2**20  # Qwen2-7B's 16-bit KV per token (28 layers x 2 x 4 heads x 128 x 2)
    assert awq["memory_from"].startswith("weights + 16-bit KV cache of 1 x 640 tokens (a lower bound")
    assert awq["memory_mib"] == pytest.approx(awq["size_bytes"] / 2**20 + kv_mib)
    wide = select(
        reg, Scenario(model="m", gpu_arch="sm90", objective="throughput", concurrency=1, memory_gib=1e-3)
    )
    assert _why(wide, "awq").startswith("needs ") and "16-bit KV cache" in _why(wide, "awq")
    on_cpu = select(reg, Scenario(model="m", cpu=True, objective="throughput"))
    assert _names(on_cpu["ranked"]) == ["gguf-q4_0@llama.cpp"]


def test_what_a_gpu_served_artifact_needs_grows_with_the_concurrent_requests(tmp_path: Path) -> None:
    """Served on a GPU, the host's RSS (a GGUF's levels carry it) is not the need, nor the GPU's
    device-wide peak: the weights plus the 16-bit KV cache of the scenario's requests are, a lower
    bound, for a llama.cpp artifact whose verdict names no device as for any other."""
    root = tmp_path / "artifacts"
    bound = decode_bound(4_000_000_000, 57_344, 640, "NVIDIA H200", tokens_per_s_c1=150.0)
    _measured(root, "gguf-q4_0", "llama.cpp", 3.0, levels=[_level(1, 30, 6, 150), _level(4, 60, 9, 500)],
              served_on=("NVIDIA H200", "sm90"), bound=bound)  # fmt: skip
    reg = Registry(root)
    reg.rebuild()
    size_mib = next(iter(select(reg, Scenario(model="m", gpu_arch="sm90"))["ranked"]))["size_bytes"] / 2**20
    kv_mib = 57_344 * 640 / 2**20
    for concurrency in (1, 4):
        [q4] = select(reg, Scenario(model="m", gpu_arch="sm90", concurrency=concurrency))["ranked"]
        assert q4["memory_mib"] == pytest.approx(size_mib + concurrency * kv_mib)
        assert q4["memory_from"].startswith(f"weights + 16-bit KV cache of {concurrency} x 640 tokens")


def test_a_gguf_with_some_layers_in_host_memory_needs_that_share_of_the_gpu(tmp_path: Path) -> None:
    """llama.cpp's -ngl 15 of Qwen2-7B's 29 (28 layers and the head): no one bandwidth bounds its
    decoding (no share, no flag) and a GPU holds that share of its weights and KV cache."""
    root = tmp_path / "artifacts"
    bound = decode_bound(4_000_000_000, 57_344, 640, "NVIDIA H200", 40.0, [], gpu_layers=(15, 29))
    assert (
        bound.share_c1 is None
        and bound.flag is None
        and bound.gpu_layer_share == pytest.approx(15 / 29, abs=1e-4)
    )
    _measured(root, "gguf-q4_0", "llama.cpp", 3.0, levels=[_level(1, 30, 6, 40)],
              served_on=("NVIDIA H200", "sm90"), bound=bound)  # fmt: skip
    reg = Registry(root)
    reg.rebuild()
    [q4] = select(reg, Scenario(model="m", gpu_arch="sm90"))["ranked"]
    whole = q4["size_bytes"] / 2**20 + 57_344 * 640 / 2**20
    assert q4["memory_mib"] == pytest.approx(whole * 15 / 29, rel=1e-3)
    assert q4["memory_from"].startswith("52% of the weights + 16-bit KV cache of 1 x 640 tokens")
    assert q4["memory_from"].endswith("the share of its layers its deploy command puts on the GPU")
    assert not any("bandwidth bound" in r for r in q4["reasons"])


def _h100_registry(tmp_path: Path, runs: dict[str, str], recipe: str = "qwen2-7b-serving") -> Registry:
    """A registry of the manifests the H100 wrote (benchmarks/results/), target -> run (a date-less
    run: 2026-12-05's), each the current version 1 of its target in `recipe`."""
    recipe_dir = tmp_path / "artifacts" / recipe
    for target, run in runs.items():
        run = run if run.startswith("2026-") else f"2026-12-05-serving-{run}"
        collected = ROOT / f"benchmarks/results/h100-{run}-manifest.json"
        for where in (recipe_dir / target, recipe_dir / ".versions" / target / "1"):
            where.mkdir(parents=True)
            (where / "manifest.json").write_bytes(collected.read_bytes())
    reg = Registry(tmp_path / "artifacts")
    reg.rebuild()
    return reg


def test_select_answers_from_the_gpu_host_s_own_record(tmp_path: Path) -> None:
    """The 7B-shaped GPTQ manifest as the H100 wrote it (2026-12-05, third device session): the
    registry reads it here and `select` ranks it by its measured levels at either workload, with
    the card and the bandwidth bound in its reasons."""
    reg = _h100_registry(tmp_path, {"gptq": "run3-gptq"})
    full = select(reg, Scenario(gpu_arch="sm90", objective="throughput", concurrency=128))
    assert _names(full["ranked"]) == ["gptq@vllm"]
    reasons = " ".join(full["ranked"][0]["reasons"])
    assert "at concurrency 128 of 512/128 tokens on NVIDIA H100 80GB HBM3: 6602.3 output tokens/s" in reasons
    single = select(reg, Scenario(gpu_arch="sm90", objective="latency", concurrency=1, workload="2048/256"))
    assert "31% of its 730 tokens/s bandwidth bound" in " ".join(single["ranked"][0]["reasons"])
    assert "no SGLang environment" in full["excluded"][0]["excluded"]  # its SGLang verdict was skipped
    assert not select(reg, Scenario(gpu_arch="sm80", objective="throughput"))["ranked"]  # an sm90 record


def test_select_picks_between_the_h100_s_gptq_and_fp8_records_by_objective(tmp_path: Path) -> None:
    """Two manifests the H100 wrote for the same 7B-shaped source (2026-12-05, third and fourth
    device sessions): ModelOpt FP8 wins throughput at 128 streams, first-token latency at 1 and
    ΔPPL; the GPTQ W4A16 checkpoint wins size. Each answer names the measured numbers."""
    reg = _h100_registry(tmp_path, {"gptq": "run3-gptq", "modelopt-fp8": "run4-modelopt-fp8"})
    fp8_first = ["modelopt-fp8@vllm", "gptq@vllm"]
    full = select(reg, Scenario(gpu_arch="sm90", objective="throughput", concurrency=128))
    assert _names(full["ranked"]) == fp8_first
    assert "on NVIDIA H100 80GB HBM3: 9193.5 output tokens/s" in " ".join(full["ranked"][0]["reasons"])
    single = select(reg, Scenario(gpu_arch="sm90", objective="latency", concurrency=1, workload="2048/256"))
    assert _names(single["ranked"]) == fp8_first
    assert "58% of its 432 tokens/s bandwidth bound" in " ".join(single["ranked"][0]["reasons"])
    assert _names(select(reg, Scenario(gpu_arch="sm90", objective="accuracy"))["ranked"]) == fp8_first
    assert _names(select(reg, Scenario(gpu_arch="sm90", objective="size"))["ranked"]) == fp8_first[::-1]


def test_select_ranks_sglang_s_serving_numbers_beside_vllm_s(tmp_path: Path) -> None:
    """The H100's AWQ manifest (2026-12-05, fifth device session) holds a serving record per engine:
    SGLang's deploy command wins one stream (269.6 against vLLM's 230.7 tokens/s) and comes last at
    128 streams (3750.9); `select` ranks each (target, engine) by its own engine's numbers."""
    reg = _h100_registry(
        tmp_path, {"gptq": "run3-gptq", "modelopt-fp8": "run4-modelopt-fp8", "awq": "run5-awq"}
    )
    one = select(reg, Scenario(gpu_arch="sm90", objective="throughput", concurrency=1))
    assert _names(one["ranked"]) == ["awq@sglang", "modelopt-fp8@vllm", "gptq@vllm", "awq@vllm"]
    assert "269.6 output tokens/s" in " ".join(one["ranked"][0]["reasons"])
    commands = {f"{c['target']}@{c['engine']}": c["serve_command"] for c in one["ranked"]}
    assert commands["awq@sglang"].startswith("python -m sglang.launch_server --model-path ${ARTIFACT_DIR}")
    assert commands["awq@vllm"].startswith("python -m vllm.entrypoints.openai.api_server")
    full = select(reg, Scenario(gpu_arch="sm90", objective="throughput", concurrency=128))
    assert _names(full["ranked"]) == ["modelopt-fp8@vllm", "awq@vllm", "gptq@vllm", "awq@sglang"]
    assert "3750.9 output tokens/s" in " ".join(full["ranked"][-1]["reasons"])


def test_select_ranks_the_h100_s_gguf_record_by_llama_server_s_numbers(tmp_path: Path) -> None:
    """The H100's GGUF Q4_0 manifest (2026-12-06, sixth device session, the Llama-declared 7B shape):
    `select` ranks it by its deploy command's (llama-server's) levels, names the bound it is
    flagged below, the level its time cap cut, and answers with llama-server's command."""
    reg = _h100_registry(tmp_path, {"gguf-q4_0": "2026-12-06-serving-gguf-q4_0"}, "qwen2-7b-serving-llama")
    one = select(reg, Scenario(gpu_arch="sm90", objective="throughput", concurrency=1))
    [q4] = one["ranked"]
    assert (q4["target"], q4["engine"]) == ("gguf-q4_0", "llama.cpp")
    reasons = " ".join(q4["reasons"])
    assert "on NVIDIA H100 80GB HBM3: 229.3 output tokens/s" in reasons
    assert "28% of its 806 tokens/s bandwidth bound" in reasons
    assert q4["serve_command"].startswith("llama-server -m ${ARTIFACT_DIR}/model.gguf")
    assert "-np 128" in q4["serve_command"] and "-ngl all" in q4["serve_command"]
    full = select(reg, Scenario(gpu_arch="sm90", objective="throughput", concurrency=128))
    reasons = " ".join(full["ranked"][0]["reasons"])
    assert "375.5 output tokens/s" in reasons
    assert "CUT: the level's time cap ended it with 176 of 512 requests" in reasons


def test_select_ranks_the_h100_s_three_ggufs_and_accuracy_by_kld_where_every_one_has_it(
    tmp_path: Path,
) -> None:
    """The H100's GGUF manifests (2026-12-06, sixth and seventh device sessions): Q4_0 wins one
    stream, IQ4_XS size, and accuracy goes by llama-perplexity's full-vocabulary KLD (Q8_0 0.0006,
    IQ4_XS 0.0470, Q4_0 0.0587), not by |ΔPPL|, where Q4_0's -0.13 % would beat Q8_0's +0.37 %.
    Beside a vLLM record, which holds only a top-k lower bound, accuracy falls back to |ΔPPL| and
    says so."""
    runs = {
        "gguf-q4_0": "2026-12-06-serving-gguf-q4_0",
        "gguf-q8_0": "2026-12-06-serving-run2-gguf-q8_0",
        "gguf-iq4_xs": "2026-12-06-serving-run2-gguf-iq4_xs",
    }
    reg = _h100_registry(tmp_path, runs, "qwen2-7b-serving-llama")
    one = select(reg, Scenario(gpu_arch="sm90", objective="throughput", concurrency=1))
    assert _names(one["ranked"]) == ["gguf-q4_0@llama.cpp", "gguf-iq4_xs@llama.cpp", "gguf-q8_0@llama.cpp"]
    assert "on NVIDIA H100 80GB HBM3: 177.7 output tokens/s" in " ".join(one["ranked"][-1]["reasons"])
    size = select(reg, Scenario(gpu_arch="sm90", objective="size"))
    assert _names(size["ranked"])[0] == "gguf-iq4_xs@llama.cpp"
    accuracy = select(reg, Scenario(gpu_arch="sm90", objective="accuracy"))
    assert _names(accuracy["ranked"]) == [f"gguf-{q}@llama.cpp" for q in ("q8_0", "iq4_xs", "q4_0")]
    basis = "accuracy ranked by full-vocabulary KLD to the reference: 0.0006"
    assert basis in accuracy["ranked"][0]["reasons"]
    mixed = _h100_registry(tmp_path / "mixed", {"gptq": "run3-gptq"})
    for target, run in runs.items():  # the GGUF records beside the vLLM one, in one registry
        for where in ("", ".versions/"):
            dest = tmp_path / "mixed/artifacts/qwen2-7b-serving-llama" / where / target
            dest = dest / "1" if where else dest
            dest.mkdir(parents=True)
            collected = ROOT / f"benchmarks/results/h100-{run}-manifest.json"
            (dest / "manifest.json").write_bytes(collected.read_bytes())
    mixed.rebuild()
    both = select(mixed, Scenario(gpu_arch="sm90", objective="accuracy"))
    assert _names(both["ranked"])[0] == "gguf-q4_0@llama.cpp"  # |ΔPPL| 0.13
    assert "accuracy ranked by |ΔPPL|" in both["ranked"][0]["reasons"][-1]


def test_select_ranks_the_h100_s_three_w4a16_records_and_names_the_flagged_one(tmp_path: Path) -> None:
    """The H100's W4A16 manifests of one 7B-shaped source (2026-12-05 run3 GPTQ, 2026-12-06 run3
    AWQ and GPTQModel GPTQ, each on Machete): llm-compressor's GPTQ wins one stream (233.8 tokens/s)
    and GPTQModel's comes last (199.1, the desc_act checkpoint), flagged below 30 % of its bound."""
    runs = {
        "gptq": "run3-gptq",
        "awq": "2026-12-06-serving-run3-awq",
        "gptq-gptqmodel": "2026-12-06-serving-run3-gptq-gptqmodel",
    }
    reg = _h100_registry(tmp_path, runs)
    one = select(reg, Scenario(gpu_arch="sm90", objective="throughput", concurrency=1))
    assert _names(one["ranked"]) == ["gptq@vllm", "awq@vllm", "gptq-gptqmodel@vllm"]
    last = " ".join(one["ranked"][-1]["reasons"])
    assert "on NVIDIA H100 80GB HBM3: 199.1 output tokens/s" in last
    assert "27% of its 741 tokens/s bandwidth bound (below 30% of its bandwidth bound" in last
    full = select(reg, Scenario(gpu_arch="sm90", objective="throughput", concurrency=128))
    assert "6010.0 output tokens/s" in " ".join(full["ranked"][-1]["reasons"])


def test_a_gguf_served_on_a_gpu_needs_the_whole_kv_cache_its_command_allocates(tmp_path: Path) -> None:
    """llama-server allocates its whole -c at start whatever the requests: the H100's Q4_0 record
    (-c 327680 over 128 slots) needs its weights plus 327,680 tokens of 16-bit KV (17.5 GiB), about
    the 22,599 MiB its server held on the GPU, at one stream as at 128; a host with 20 GiB is
    refused. A vLLM record, whose cache is a share of the host's memory, keeps the lower bound."""
    reg = _h100_registry(tmp_path, {"gguf-q4_0": "2026-12-06-serving-gguf-q4_0"}, "qwen2-7b-serving-llama")
    kv_per_token = 57_344  # Qwen2-7B-shaped: 28 layers x (K + V) x 4 KV heads x 128 x 2 bytes
    for concurrency in (1, 128):
        [q4] = select(reg, Scenario(gpu_arch="sm90", concurrency=concurrency))["ranked"]
        assert q4["memory_mib"] == pytest.approx((q4["size_bytes"] + 327_680 * kv_per_token) / 2**20)
        assert q4["memory_from"] == (
            "weights + 16-bit KV cache of the 327,680 tokens its deploy command allocates at start "
            "(n_ctx 327680; a lower bound: the engine's compute buffers not counted)"
        )
    assert 21_500 < q4["memory_mib"] < 22_599  # below what the server held, compute buffers and all
    small = select(reg, Scenario(gpu_arch="sm90", memory_gib=20))
    assert not small["ranked"] and _why(small, "gguf-q4_0").startswith("needs 22")
    vllm = _h100_registry(tmp_path / "vllm", {"awq-gptqmodel": "2026-12-06-serving-run5-awq-gptqmodel"})
    [awq] = select(vllm, Scenario(gpu_arch="sm90", memory_gib=20))["ranked"]
    assert awq["memory_from"].startswith("weights + 16-bit KV cache of 1 x 640 tokens (a lower bound")


def test_an_artifact_sharded_over_gpus_needs_its_share_on_each(tmp_path: Path) -> None:
    """`--memory-gib` on a GPU host is each GPU's: the H100's Q4_0 record served at tp_size 2 needs
    half its weights and fixed KV cache on each GPU, so a host of 12 GiB cards takes it where one
    card needs ~22 GiB."""
    reg = _h100_registry(tmp_path, {"gguf-q4_0": "2026-12-06-serving-gguf-q4_0"}, "qwen2-7b-serving-llama")
    [whole] = select(reg, Scenario(gpu_arch="sm90"))["ranked"]
    assert not select(reg, Scenario(gpu_arch="sm90", memory_gib=12))["ranked"]
    for d in (reg.root / "qwen2-7b-serving-llama" / "gguf-q4_0", *reg.root.glob("*/.versions/gguf-q4_0/1")):
        manifest = read_manifest(d)
        manifest.serve.tp_size = 2
        write_manifest(d, manifest)
    reg.rebuild()
    [half] = select(reg, Scenario(gpu_arch="sm90", gpus=2, memory_gib=12))["ranked"]
    assert half["memory_mib"] == pytest.approx(whole["memory_mib"] / 2)
    assert half["memory_from"] == f"per GPU, 1/2 of the {whole['memory_from']} (tp_size 2)"
