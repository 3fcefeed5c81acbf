"""`pipeline report --html`: the page is one file that renders its plots in a real browser (Debian's
headless Chromium), offline; a broken plot is seen as broken; nothing built is one clear error."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.report import SERVING_CHART, SIZE_CHART, ReportRow
from tests.conftest import chart_points, render_in_chromium, write_recipe

GGUF = {"kind": "gguf", "quant": "F16", "gates": {"max_ppl_delta_pct": 1.0, "max_kld_mean": 0.01}}
AWQ = {"kind": "awq", "group_size": 64, "gates": {"max_ppl_delta_pct": 30.0, "max_kld_topk_mean": 0.3}}
TARGETS = {"gguf-f16": GGUF, "gguf-q4_0": {**GGUF, "quant": "Q4_0"}, "awq": AWQ}


def _metrics(target: str, engine: str, quant: str, status: str, size: float, delta: float | None,
             serving: dict[int, tuple[float, float]] | None = None) -> dict:  # fmt: skip
    """A metrics file as `pipeline build` writes it (Project._write_metrics)."""
    record = {"status": status, "engine": engine, "quant": quant, "size_mib": size,
              "verdicts": {engine: status}, "ppl_delta_pct": delta, "kld_mean": 0.01,
              "kld_topk_mean": None, "token_agreement": 0.9, "tokens_per_s": 50.0}  # fmt: skip
    if serving is not None:
        record[f"serving_{engine}"] = "passed"
        for c, (ttft, tps) in serving.items():
            key = f"serving_c{c}_"
            record |= {key + "ttft_ms_p99": ttft, key + "itl_ms_p99": 20.0,
                       key + "output_tokens_per_s": tps, key + "peak_rss_mib": 400.0}  # fmt: skip
    return record


def _built(recipe_dir: Path, artifacts: Path, serving: bool = True) -> Path:
    recipe = write_recipe(recipe_dir / "tiny.yaml", targets=TARGETS)
    metrics = artifacts / "tiny" / ".metrics"
    metrics.mkdir(parents=True)
    records = {
        "gguf-f16": _metrics("gguf-f16", "llama.cpp", "F16", "passed", 258.0, 0.01,
                             {1: (300.0, 24.0), 4: (3900.0, 27.0)} if serving else None),
        "gguf-q4_0": _metrics("gguf-q4_0", "llama.cpp", "Q4_0", "passed", 88.0, 24.0,
                              {1: (310.0, 49.0), 4: (2600.0, 43.0)} if serving else None),
        "awq": _metrics("awq", "vllm", "awq-w4a16-g64", "failed", 120.0, 40.0),
    }  # fmt: skip
    for target, record in records.items():
        (metrics / f"{target}.json").write_text(json.dumps(record))
    return recipe


def test_the_page_renders_both_plots_in_headless_chromium(
    tmp_path: Path, tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    recipe = _built(tiny_recipe_dir, _isolated_artifacts)
    page = tmp_path / "report.html"
    res = CliRunner().invoke(app, ["report", str(recipe), "--html", str(page)])
    assert res.exit_code == 0, res.output
    text = page.read_text()
    assert "cdn.jsdelivr" not in text and "<script src" not in text  # one self-contained file
    dom = render_in_chromium(page, tmp_path / "profile", screenshot=tmp_path / "report.png")
    assert 'data-rendered="2"' in dom and "data-error" not in dom
    assert (tmp_path / "report.png").stat().st_size > 10_000
    # one point per target with a size and a ΔPPL, each labelled with its numbers
    labels = chart_points(dom, SIZE_CHART)
    assert len(labels) == 3 and any("target: gguf-q4_0" in s and "size_mib: 88" in s for s in labels)
    points = chart_points(dom, SERVING_CHART)
    assert len(points) == 4  # two artifacts x two concurrency levels; the failed AWQ has none
    assert any("concurrency: 4" in p and "ttft_ms_p99: 2600" in p for p in points), points
    # the table carries every target, the failed one marked
    assert text.count("<tr class=") == 3 and 'class="status-failed"' in text


def test_a_plot_that_cannot_render_is_seen_failing(
    tmp_path: Path, tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    recipe = _built(tiny_recipe_dir, _isolated_artifacts)
    page = tmp_path / "report.html"
    assert CliRunner().invoke(app, ["report", str(recipe), "--html", str(page)]).exit_code == 0
    text = page.read_text()
    broken = text.replace('"mark": {"type": "point"', '"mark": {"type": "no-such-mark"', 1)
    assert broken != text
    page.write_text(broken)
    dom = render_in_chromium(page, tmp_path / "profile")
    assert "data-rendered" not in dom and "data-error=" in dom


def test_without_serving_numbers_the_page_says_so(
    tmp_path: Path, tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    recipe = _built(tiny_recipe_dir, _isolated_artifacts, serving=False)
    page = tmp_path / "report.html"
    assert CliRunner().invoke(app, ["report", str(recipe), "--html", str(page)]).exit_code == 0
    dom = render_in_chromium(page, tmp_path / "profile")
    assert 'data-rendered="1"' in dom and "no serving numbers yet" in dom


def test_nothing_built_is_one_clear_error(
    tmp_path: Path, tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml", targets=TARGETS)
    page = tmp_path / "report.html"
    res = CliRunner().invoke(app, ["report", str(recipe), "--html", str(page)])
    assert res.exit_code == 1 and "nothing to report for tiny: no target has metrics yet" in res.output
    assert not page.exists()


def test_serving_levels_are_read_back_from_the_metrics_keys() -> None:
    row = ReportRow.from_metrics({"target": "t", **_metrics("t", "llama.cpp", "Q8_0", "passed", 1.0, 0.5,
                                                            {8: (5.0, 80.0), 1: (1.0, 10.0)})})  # fmt: skip
    assert [p.concurrency for p in row.serving] == [1, 8]
    assert row.serving_status == "passed" and row.at(8).output_tokens_per_s == 80.0 and row.at(2) is None


def test_numbers_measured_on_a_busy_host_are_marked_contended() -> None:
    """A level or a validation during which other processes took over a quarter of the CPUs says so
    in the table; a quiet one does not."""
    from pipeline.report import _table

    record = {
        "target": "t",
        **_metrics("t", "llama.cpp", "Q8_0", "passed", 1.0, 0.5, {1: (5.0, 80.0), 4: (9.0, 90.0)}),
    }
    quiet = _table([ReportRow.from_metrics({**record, "serving_c1_others_cpu_share": 0.02})])
    assert "contended" not in quiet
    busy = ReportRow.from_metrics(
        {**record, "serving_c1_others_cpu_share": 0.6, "serving_c4_others_cpu_share": 0.1,
         "tokens_per_s_others_cpu_share": 0.9}
    )  # fmt: skip
    assert busy.at(1).others_cpu_share == 0.6
    cells = _table([busy]).split("<td>")
    marked = [c for c in cells if "contended" in c]
    assert len(marked) == 2 and "other processes used 60% of the CPUs" in "".join(marked)
    assert any(c.startswith("50.0 ") for c in marked)  # tokens/s, 90 % busy


def test_a_target_built_on_both_hosts_is_a_row_each_saying_where_it_was_served(
    tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    """The GPU host's numbers (its DVC project's metrics) beside the CPU host's: a row each, the
    GPU's name and concurrency 1's share of its bandwidth bound in the table."""
    from pipeline.constants import GPU_METRICS_DIRNAME
    from pipeline.project import Project
    from pipeline.report import _table, report_rows

    recipe = _built(tiny_recipe_dir, _isolated_artifacts)
    gpu = _isolated_artifacts / "tiny" / GPU_METRICS_DIRNAME
    gpu.mkdir()
    record = _metrics("gguf-q4_0", "llama.cpp", "Q4_0", "passed", 88.0, 24.0, {1: (40.0, 180.0)})
    record |= {"serving_device": "NVIDIA H100 80GB HBM3", "serving_bound_share_c1": 0.42}
    (gpu / "gguf-q4_0.json").write_text(json.dumps(record))
    rows = report_rows(Project.open(recipe).report())
    q4 = [r for r in rows if r.target == "gguf-q4_0"]
    assert [(r.host, r.measured_on) for r in q4] == [("cpu", "cpu host"), ("gpu", "NVIDIA H100 80GB HBM3")]
    table = _table(rows)
    assert table.count("<tr class=") == 4 and "NVIDIA H100 80GB HBM3" in table and "<td>42%</td>" in table


def test_every_serving_level_is_a_row_with_its_percentiles_and_peak_memory() -> None:
    """The page's second table: each level of each target with TTFT and ITL p50/p99, throughput and
    both peaks (GPU memory from the GPU host, RSS from the CPU host)."""
    from pipeline.report import _levels_table

    record = {
        "target": "awq",
        **_metrics("awq", "vllm", "awq", "passed", 4.0, 2.0, {1: (31.0, 210.0), 8: (60.0, 1650.0)}),
    }
    record |= {"serving_device": "NVIDIA H200", "serving_c1_ttft_ms_p50": 18.0, "serving_c1_itl_ms_p50": 3.75,
               "serving_c1_peak_gpu_mib": 126_500.0, "serving_workload": "512/128",
               "serving_2048x256_c8_output_tokens_per_s": 990.0, "serving_2048x256_c8_incomplete": 8,
               "serving_2048x256_c8_streamed_tokens_per_s": 1210.0,
               "serving_2048x256_c1_output_tokens_per_s": 190.0, "serving_2048x256_c1_incomplete": 0,
               "serving_10000x16_c1_output_tokens_per_s": 50.0}  # fmt: skip
    row = ReportRow.from_metrics(record)
    assert [(p.workload, p.concurrency) for p in row.serving] == [("512/128", 1), ("512/128", 8)]
    assert [(p.workload, p.concurrency, p.output_tokens_per_s) for p in row.more_serving] == [
        ("2048/256", 1, 190.0), ("2048/256", 8, 990.0), ("10000/16", 1, 50.0)]  # fmt: skip
    table = _levels_table([row])
    rows = table.split("<tr>")[2:]  # after the header row
    assert (  # the level its time cap cut says so beside its tokens/s
        len(rows) == 5 and "<td>2048/256</td><td>8</td><td>– / –</td><td>– / –</td><td>990.0 <span" in rows[3]
    )
    assert ">cut</span> (streamed 1210.0)" in rows[3] and "cut" not in rows[2]
    assert (
        "<td>NVIDIA H200</td><td>512/128</td><td>1</td><td>18 / 31</td><td>3.8 / 20.0</td><td>210.0</td>"
        "<td>126,500</td><td>400</td>" in rows[0]
    )
    assert "<td>– / 60</td>" in rows[1] and "<td>1650.0</td><td>–</td>" in rows[1]
    assert (
        _levels_table(
            [ReportRow.from_metrics({"target": "t", **_metrics("t", "vllm", "awq", "failed", 1.0, 9.0)})]
        )
        == ""
    )


def test_a_build_s_metrics_carry_each_workload_s_levels_back_to_the_page(
    tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    """What `pipeline build` writes for the page (Project._write_metrics): the first workload's levels
    unprefixed with its shape, a further workload's under its prompt x output tokens."""
    from pipeline.manifest import ServingLevel, ServingResult, WorkloadRun, read_manifest
    from pipeline.project import Project
    from pipeline.report import report_rows
    from tests.conftest import write_artifact

    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml", targets=TARGETS)
    project = Project.open(recipe)
    manifest = read_manifest(write_artifact(_isolated_artifacts, "tiny", "awq", "vllm", "awq"))

    def level(c: int, tps: float) -> ServingLevel:
        return ServingLevel(
            concurrency=c, completed=4, errored=0, output_tokens_per_s=tps, peak_gpu_mib=9000.0
        )

    manifest.serving = {"vllm": ServingResult(
        status="passed", workload={"prompt_tokens": 64, "output_tokens": 32}, levels={"1": level(1, 40.0)},
        more_workloads=[WorkloadRun(workload={"prompt_tokens": 256, "output_tokens": 8},
                                    levels={"1": level(1, 30.0), "4": level(4, 90.0)})],
    )}  # fmt: skip
    project._write_metrics("awq", manifest, gpu_host=False)
    from dataclasses import fields

    from pipeline.constants import SERVING_METRICS
    from pipeline.report import ServingPoint

    assert set(SERVING_METRICS) <= {f.name for f in fields(ServingPoint)}  # every key written is read back
    record = json.loads(project.layout.metrics_path("awq").read_text())
    assert record["serving_workload"] == "64/32" and record["serving_c1_peak_gpu_mib"] == 9000.0
    assert record["serving_256x8_c4_output_tokens_per_s"] == 90.0
    [row] = [r for r in report_rows(project.report()) if r.target == "awq"]
    points = [(p.workload, p.concurrency, p.output_tokens_per_s) for p in [*row.serving, *row.more_serving]]
    assert points == [("64/32", 1, 40.0), ("256/8", 1, 30.0), ("256/8", 4, 90.0)]
    # `engines: all`: another engine's numbers sit beside the primary one's, never over them
    sglang = ServingResult(status="passed", device="NVIDIA H100 80GB HBM3", levels={"1": level(1, 55.0)},
                           workload={"prompt_tokens": 64, "output_tokens": 32})  # fmt: skip
    manifest.serving |= {"sglang": sglang}
    manifest.validation.engines["sglang"] = manifest.validation.engines["vllm"]  # its verdict passed too
    project._write_metrics("awq", manifest, gpu_host=False)
    record = json.loads(project.layout.metrics_path("awq").read_text())
    assert record["serving_c1_output_tokens_per_s"] == 40.0 and record["serving_device"] is None
    assert record["serving_sglang_c1_output_tokens_per_s"] == 55.0
    assert record["serving_sglang_device"] == "NVIDIA H100 80GB HBM3" and record["serving_sglang"] == "passed"
    # the page: a row for each engine, the other one's with its own verdict and levels, no quality columns
    vllm_row, sglang_row = [r for r in report_rows(project.report()) if r.target == "awq"]
    assert (vllm_row.engine, [p.output_tokens_per_s for p in vllm_row.serving]) == ("vllm", [40.0])
    assert (sglang_row.engine, sglang_row.status, sglang_row.serving_status) == ("sglang", "passed", "passed")
    assert [(p.workload, p.output_tokens_per_s) for p in sglang_row.serving] == [("64/32", 55.0)]
    assert sglang_row.ppl_delta_pct is None and sglang_row.measured_on == "NVIDIA H100 80GB HBM3"


def test_a_gpu_host_s_build_reports_here_without_its_source(
    tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    """A build whose steps ran on a GPU says so in its metrics (`host: gpu`; a CPU host's records
    stay as they were), and the GPU host's committed metrics (gpu/artifacts/qwen2-7b-serving: the
    H100's GPTQ, 2026-12-05) report on this host, where the recipe's source checkpoint is not."""
    from pipeline.manifest import StepRecord, read_manifest
    from pipeline.project import Project
    from tests.conftest import write_artifact

    project = Project.open(write_recipe(tiny_recipe_dir / "tiny.yaml", targets=TARGETS))
    manifest = read_manifest(write_artifact(_isolated_artifacts, "tiny", "awq", "vllm", "awq"))
    step = StepRecord(env="vllm", op="validate", log="awq", seconds=1.0, peak_rss_mib=100.0)
    manifest.build.steps = [step]
    project._write_metrics("awq", manifest, gpu_host=False)
    assert "host" not in json.loads(project.layout.metrics_path("awq").read_text())
    manifest.build.steps = [step.model_copy(update={"peak_gpu_mib": 76_000.0})]
    project._write_metrics("awq", manifest, gpu_host=False)
    assert [(r["target"], r["host"]) for r in project.report()] == [("awq", "gpu")]

    committed = Path(__file__).resolve().parent.parent / "gpu/artifacts/qwen2-7b-serving/.metrics"
    metrics = _isolated_artifacts / "qwen2-7b-serving" / ".metrics"
    metrics.mkdir(parents=True)
    for f in committed.glob("*.json"):
        (metrics / f.name).write_bytes(f.read_bytes())
    recipe = Path(__file__).resolve().parent.parent / "benchmarks/gpu/qwen2-7b-serving.yaml"
    res = CliRunner().invoke(app, ["report", str(recipe), "--json"])
    assert res.exit_code == 0, res.output
    [gptq] = [r for r in json.loads(res.output) if r["target"] == "gptq"]
    assert gptq["host"] == "gpu" and gptq["serving_device"] == "NVIDIA H100 80GB HBM3"
    assert gptq["serving_c128_output_tokens_per_s"] > 6000 and gptq["serving_2048x256_c1_itl_ms_p50"] < 5
    built = CliRunner().invoke(app, ["build", str(recipe)])  # building does need the source here
    assert built.exit_code != 0 and "source.path" in built.output


REPO = Path(__file__).resolve().parent.parent


def test_the_gpu_hosts_7b_numbers_are_shown_beside_the_cpu_hosts(
    tmp_path: Path, tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    """`--beside`: the committed GPU-host metrics (gpu/artifacts: the H100's 7B serving recipes) on
    the CPU host's page, each row naming its recipe, both hosts' serving levels in one plot (log
    scales: ~50 against ~9,000 tokens/s), and in --json."""
    recipe = _built(tiny_recipe_dir, _isolated_artifacts)
    committed = sorted((REPO / "gpu/artifacts").rglob("*"))
    before = {f: f.stat().st_mtime_ns for f in committed}
    page = tmp_path / "report.html"
    beside = ["--beside", str(REPO / "benchmarks/gpu/qwen2-7b-serving.yaml"),
              "--beside", str(REPO / "benchmarks/gpu/qwen2-7b-serving-llama.yaml"),
              "--beside-artifacts", str(REPO / "gpu/artifacts")]  # fmt: skip
    res = CliRunner().invoke(app, ["report", str(recipe), "--html", str(page), "--json", *beside])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output[res.output.index("[") :])
    by_recipe = {r["recipe"] for r in rows}
    assert by_recipe == {"tiny", "qwen2-7b-serving", "qwen2-7b-serving-llama"}
    [q8] = [r for r in rows if (r["recipe"], r["target"]) == ("qwen2-7b-serving-llama", "gguf-q8_0")]
    assert q8["serving_device"] == "NVIDIA H100 80GB HBM3" and q8["serving_c1_output_tokens_per_s"] > 100
    text = page.read_text()
    assert "pipeline report: tiny beside qwen2-7b-serving, qwen2-7b-serving-llama" in text
    assert "<th>recipe</th>" in text and "<td>qwen2-7b-serving-llama</td>" in text
    assert '"type": "log"' in text
    dom = render_in_chromium(page, tmp_path / "profile")
    assert 'data-rendered="2"' in dom and "data-error" not in dom
    points = chart_points(dom, SERVING_CHART)
    tiny = [p for p in points if "target: tiny: " in p]
    assert len(tiny) == 4  # the CPU host's two artifacts x two levels
    gpu = [p for p in points if "measured_on: NVIDIA H100 80GB HBM3" in p]
    assert len(gpu) >= 8 * 4 and any("target: qwen2-7b-serving: modelopt-fp8" in p for p in gpu)
    # the committed GPU-host files were only read (the DVC scatter data is the main recipe's alone)
    assert sorted((REPO / "gpu/artifacts").rglob("*")) == committed
    assert {f: f.stat().st_mtime_ns for f in committed} == before


def test_a_beside_recipe_without_metrics_is_one_clear_error(
    tmp_path: Path, tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    """A wrong --beside-artifacts never makes a page silently without the other recipe."""
    recipe = _built(tiny_recipe_dir, _isolated_artifacts)
    page = tmp_path / "report.html"
    other = str(REPO / "benchmarks/gpu/qwen2-7b-serving.yaml")
    res = CliRunner().invoke(app, ["report", str(recipe), "--html", str(page), "--beside", other,
                                   "--beside-artifacts", str(tmp_path / "elsewhere")])  # fmt: skip
    assert res.exit_code == 1, res.output
    assert "--beside" in res.output and "no target of qwen2-7b-serving has metrics under" in res.output
    assert not page.exists()
    res = CliRunner().invoke(app, ["report", str(recipe), "--beside", str(tmp_path / "none.yaml")])
    assert res.exit_code == 2 and "none.yaml" in res.output
