"""The serving table (benchmarks/serving_table.py): one section per card from the GPU kit's results
files, the latest run winning, cut and windowed levels marked, every artifact no card served listed
with its reason; the committed table is the one the committed results give."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import serving_table

RESULTS = REPO / "benchmarks" / "results"


def _level(tps: float, ratio: float | None = 1.0, incomplete: int = 0) -> dict[str, Any]:
    side = {"output_tokens_per_s": tps, "ttft_ms_p50": 20.0, "ttft_ms_p99": 40.0, "itl_ms_p50": 4.0,
            "planned": 32, "incomplete": incomplete, "completed": 32 - incomplete}  # fmt: skip
    return {"project": side, "raw": dict(side), "ratio": ratio}


def _row(target: str, device: str, tps: float, **level: Any) -> dict[str, Any]:
    levels = {c: _level(tps * int(c), **level) for c in ("1", "8", "32", "128")}
    workload = {"prompt_tokens": 512, "output_tokens": 128}
    bound = {"share_c1": 0.25, "bound_tokens_per_s": 4 * tps, "flag": "below 30%"}
    serving = {
        "status": "passed",
        "workloads": [{"workload": workload, "levels": levels, "decode_bound": bound}],
    }
    return {"target": target, "engine": "vllm", "device": device, "status": "passed", "serving": serving}


def _with_longer(row: dict[str, Any], levels: dict[str, Any]) -> dict[str, Any]:
    """`row` with a second workload, 2048/256 tokens, of these levels."""
    longer = {"workload": {"prompt_tokens": 2048, "output_tokens": 256}, "levels": levels, "decode_bound": {}}
    row["serving"]["workloads"].append(longer)
    return row


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(rows))
    return path


def test_the_latest_run_of_a_card_wins_and_marks_what_a_cap_cut(tmp_path: Path) -> None:
    first = _write(tmp_path / "h100-2026-12-05-serving.json", [_row("gptq", "H100", 100.0)])
    later = _write(
        tmp_path / "h100-2026-12-05-serving-run2.json", [_row("gptq", "H100", 200.0, incomplete=3)]
    )
    other = _write(
        tmp_path / "h200-2026-12-06-serving.json", [_row("modelopt-fp8", "H200", 300.0, ratio=0.9)]
    )
    text = serving_table.table([later, other, first])  # the order named does not matter: the names do
    gptq = [
        line for line in text.splitlines() if line.startswith("| GPTQ W4A16 g128 (llm-compressor) | vllm")
    ]
    assert len(gptq) == 1 and "| 200.0 cut | 1,600.0 cut |" in gptq[0]  # run2, each level cut
    assert gptq[0].endswith("| h100-2026-12-05-serving-run2.json |")
    assert "25% of 800 (flagged)" in gptq[0]
    assert text.index("## H100") < text.index("## H200")
    fp8 = next(line for line in text.splitlines() if line.startswith("| FP8 (ModelOpt)"))
    assert "| 0.900 |" in fp8  # one ratio, every level: shown once


def test_a_flagged_workload_names_its_validation_kernel_and_its_server_s_mode_lines(tmp_path: Path) -> None:
    old, new = _row("gptq", "H100", 100.0), _row("awq", "H100", 100.0)
    old["kernels"] = ["MacheteLinearKernel for CompressedTensorsWNA16"]  # no engine_mode: an older run
    new["serving"]["engine_mode"] = ["Using FLASH_ATTN attention backend", "Enforce eager set"]
    fine = _row("gptq-gptqmodel", "H100", 100.0)
    fine["serving"]["workloads"][0]["decode_bound"] = {"share_c1": 0.5, "bound_tokens_per_s": 200.0}
    text = serving_table.table([_write(tmp_path / "h100-2026-12-05-serving.json", [old, new, fine])])
    flagged = text.split("(flagged), with its kernels and mode:")[1].strip().split("\n\n")[0].splitlines()
    assert flagged == [
        "- GPTQ W4A16 g128 (llm-compressor) in vllm (`gptq`), 512/128: 25% of 400 tok/s; kernel at "
        "validation: MacheteLinearKernel for CompressedTensorsWNA16; its benchmark server logged: not "
        "recorded (runs before 2026-12-07 12:05 UTC, when the kit began recording it)",
        "- AWQ W4A16 g128 (llm-compressor) in vllm (`awq`), 512/128: 25% of 400 tok/s; kernel at "
        "validation: none named in vllm's validation logs; its benchmark server logged: Using FLASH_ATTN "
        "attention backend; Enforce eager set",
    ]


def test_an_artifact_no_card_served_names_its_reason(tmp_path: Path) -> None:
    failed = {"target": "awq", "engine": "vllm", "device": "H100", "status": "failed",
              "reason": "vllm: the server did not start"}  # fmt: skip
    not_ready = {"status": "failed", "reason": "the server did not become ready in 600 s"}
    sglang = {
        "target": "gptq",
        "engine": "sglang",
        "device": "H100",
        "status": "passed",
        "serving": not_ready,
    }
    crashed = {"target": "gguf-q8_0", "model": "m", "status": "error", "reason": "pipeline build exited 1"}
    rows = [_row("gptq", "H100", 100.0), failed, sglang, crashed]  # a build error names no engine
    text = serving_table.table([_write(tmp_path / "h100-2026-12-05-serving.json", rows)])
    awq = "- AWQ W4A16 g128 (llm-compressor) in vllm (`awq`): its latest row says failed: vllm: the server"
    assert awq in text
    assert "- GGUF Q4_0 in llama.cpp (`gguf-q4_0`): no results file holds a row for it" in text
    assert "(`gguf-q8_0`): its latest row says error: pipeline build exited 1" in text
    assert (
        "in sglang (`gptq`): its latest serving record says failed: the server did not become ready" in text
    )
    assert "(`gptq`)" not in text.split("## Not served on any card yet")[1].split("in sglang")[0]


def test_a_level_from_before_whole_waves_is_marked_windowed(tmp_path: Path) -> None:
    row = _row("gptq", "H200", 100.0)
    for level in row["serving"]["workloads"][0]["levels"].values():
        del level["project"]["planned"]  # the first H200 session's 15 s windows kept no plan
    text = serving_table.table([_write(tmp_path / "h200-2026-12-05-serving.json", [row])])
    assert "| 100.0 w | 800.0 w | 3,200.0 w | 12,800.0 w |" in text


def test_the_committed_table_is_what_the_committed_results_give() -> None:
    """`benchmarks/results/serving-table.md` regenerated: a results file added or changed without
    the table rewritten fails here."""
    files = sorted(RESULTS.glob("h*-serving*.json"))
    got = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "serving_table.py"), *map(str, files)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert got == (RESULTS / "serving-table.md").read_text()
    assert "| FP8 (ModelOpt) | vllm | 512/128 | 256.2 | 1,758.4 | 4,781.2 | 9,193.5 | 1.003–1.021 |" in got


def test_a_raw_side_the_lease_did_not_reach_says_so(tmp_path: Path) -> None:
    row = _row("awq", "H100", 100.0, ratio=None)
    row["serving"] |= {"raw_status": "not run", "raw_reason": "the lease ended"}
    text = serving_table.table([_write(tmp_path / "h100-2026-12-05-serving.json", [row])])
    awq = next(line for line in text.splitlines() if line.startswith("| AWQ W4A16 g128 (llm-compressor)"))
    assert "| 100.0 | 800.0 | 3,200.0 | 12,800.0 | raw not run |" in awq


def test_a_settings_sweep_the_lease_ended_shows_the_rows_it_wrote(tmp_path: Path) -> None:
    row = _row("gptq", "H100", 100.0)
    done = {"status": "passed", "output_tokens_per_s": 100.0, "ratio": 1.0, "levels": {}}
    row["settings"] = {"status": "partial", "workload": {"prompt_tokens": 512, "output_tokens": 128},
                       "settings": {"as recorded": done}}  # fmt: skip
    text = serving_table.table([_write(tmp_path / "h100-2026-12-05-serving.json", [row])])
    assert "| GPTQ W4A16 g128 (llm-compressor) | vllm | as recorded | 512/128 | 100.0 (1.000) |" in text


def test_a_setting_level_a_cap_cut_shows_what_each_server_streamed(tmp_path: Path) -> None:
    """A cut setting level: the streamed ratio its row recorded, or (files before 2026-12-08) the one
    its streamed tokens/s and the command's as recorded give; none where neither recorded it."""
    row = _row("gptq", "H100", 100.0)
    cut = {"output_tokens_per_s": 1429.3, "ratio": None, "incomplete": 128, "streamed_tokens_per_s": 1641.2}
    one = {"status": "passed", "output_tokens_per_s": 228.9, "ratio": 1.0}
    recorded = {**cut, "output_tokens_per_s": 1638.4, "streamed_tokens_per_s": 1960.7}
    settings = {
        "as recorded": {**one, "levels": {"128": recorded}},
        "mixed chunk": {**one, "levels": {"128": cut}},
        "recorded": {**one, "levels": {"128": {**cut, "streamed_ratio": 0.5}}},
        "older": {**one, "levels": {"128": {**cut, "streamed_tokens_per_s": None}}},
    }
    row["settings"] = {"status": "passed", "workload": {"prompt_tokens": 2048, "output_tokens": 256},
                       "settings": settings}  # fmt: skip
    text = serving_table.table([_write(tmp_path / "h100-2026-12-08-serving.json", [row])])
    lines = {line.split(" | ")[2]: line for line in text.splitlines() if " | 2048/256 | " in line}
    assert lines["mixed chunk"].endswith("| 1,429.3 cut (–; streamed 0.837) | h100-2026-12-08-serving.json |")
    assert "| 1,638.4 cut (–; streamed 1.000) |" in lines["as recorded"]
    assert "| 1,429.3 cut (–; streamed 0.500) |" in lines["recorded"]
    assert "| 1,429.3 cut (–) |" in lines["older"]


def test_a_later_run_without_its_raw_side_shows_the_last_measured_ratio_and_where(tmp_path: Path) -> None:
    first = _write(tmp_path / "h100-2026-12-05-serving.json", [_row("gptq", "H100", 100.0, ratio=0.99)])
    later_row = _row("gptq", "H100", 200.0, ratio=None)
    later_row["serving"] |= {"raw_status": "not run", "raw_reason": "the lease ended"}
    later = _write(tmp_path / "h100-2026-12-05-serving-run2.json", [later_row])
    text = serving_table.table([first, later])
    gptq = next(line for line in text.splitlines() if line.startswith("| GPTQ"))
    assert "| 200.0 |" in gptq and "| raw not run; 0.990 in h100-2026-12-05-serving.json |" in gptq


def test_a_sweep_of_a_run_that_did_not_serve_the_artifact_again_is_shown(tmp_path: Path) -> None:
    """`--raw-steps settings` alone: the row holds the sweep but no serving record; the artifact's
    numbers stay the earlier file's, its sweep is listed from the later one."""
    first = _write(tmp_path / "h100-2026-12-05-serving.json", [_row("gptq", "H100", 100.0, ratio=0.99)])
    swept = {k: v for k, v in _row("gptq", "H100", 0.0).items() if k != "serving"}
    done = {"status": "passed", "output_tokens_per_s": 90.0, "ratio": 0.9, "levels": {}}
    swept["settings"] = {"status": "passed", "workload": {"prompt_tokens": 512, "output_tokens": 128},
                         "settings": {"marlin": done}}  # fmt: skip
    later = _write(tmp_path / "h100-2026-12-05-serving-run2.json", [swept])
    text = serving_table.table([first, later])
    assert "| 100.0 |" in next(line for line in text.splitlines() if line.startswith("| GPTQ"))
    assert "| GPTQ W4A16 g128 (llm-compressor) | vllm | marlin | 512/128 | 90.0 (0.900) | – | – | – |" in text
    assert "h100-2026-12-05-serving-run2.json |" in text


def test_a_later_run_of_one_workload_leaves_the_other_workloads_row_standing(tmp_path: Path) -> None:
    """ONE_WORKLOAD=1 on a later lease: its 512/128 row replaces the earlier one, the earlier
    file's 2048/256 row stays, each naming its own file."""
    both = _with_longer(_row("awq", "H100", 100.0), {"1": _level(50.0)})
    first = _write(tmp_path / "h100-2026-12-05-serving.json", [both])
    later = _write(tmp_path / "h100-2026-12-06-serving-run3.json", [_row("awq", "H100", 200.0)])
    text = serving_table.table([first, later])
    awq = [line for line in text.splitlines() if line.startswith("| AWQ W4A16 g128 (llm-compressor) | vllm")]
    assert len(awq) == 2
    assert "| 512/128 | 200.0 |" in awq[0] and awq[0].endswith("| h100-2026-12-06-serving-run3.json |")
    assert "| 2048/256 | 50.0 |" in awq[1] and awq[1].endswith("| h100-2026-12-05-serving.json |")


def test_a_later_run_of_fewer_levels_leaves_the_fuller_row_and_lends_its_ratio(tmp_path: Path) -> None:
    """CONCURRENCY="1, 128" on a later run (the raw side of one artifact): the earlier run of all four
    levels keeps the row; the later run's ratio is named beside it. A later run of every level wins."""
    ours_alone = _row("gptq", "H100", 100.0, ratio=None)
    ours_alone["serving"] |= {"raw_status": "not run", "raw_reason": "R=none"}
    first = _write(tmp_path / "h100-2026-12-07-serving.json", [ours_alone])
    fewer = _row("gptq", "H100", 110.0, ratio=1.04)
    levels = fewer["serving"]["workloads"][0]["levels"]
    fewer["serving"]["workloads"][0]["levels"] = {c: levels[c] for c in ("1", "128")}
    later = _write(tmp_path / "h100-2026-12-07-serving-run2.json", [fewer])
    text = serving_table.table([first, later])
    gptq = next(line for line in text.splitlines() if line.startswith("| GPTQ"))
    assert "| 100.0 | 800.0 | 3,200.0 | 12,800.0 |" in gptq
    assert "| raw not run; 1.040 in h100-2026-12-07-serving-run2.json |" in gptq
    assert gptq.endswith("| h100-2026-12-07-serving.json |")
    full = _write(tmp_path / "h100-2026-12-07-serving-run3.json", [_row("gptq", "H100", 120.0)])
    gptq = next(line for line in serving_table.table([first, later, full]).splitlines() if "| GPTQ" in line)
    assert "| 120.0 |" in gptq and gptq.endswith("| h100-2026-12-07-serving-run3.json |")


def test_a_cut_level_shows_what_it_streamed_and_that_ratio(tmp_path: Path) -> None:
    """From 2026-12-07 a level records what the server streamed inside its window, cut requests
    included: a cut level shows it beside its finished-only tokens/s, and its ratio of streamed
    tokens joins the ratio column, named as such (its finished-only ratio is none)."""
    row = _row("gguf-q4_0", "H100", 100.0)
    row["engine"] = "llama.cpp"
    levels = row["serving"]["workloads"][0]["levels"]
    levels["128"]["project"] |= {"incomplete": 128, "streamed_tokens_per_s": 700.0}
    levels["128"] |= {"ratio": None, "streamed_ratio": 1.55}
    text = serving_table.table([_write(tmp_path / "h100-2026-12-07-serving.json", [row])])
    q4 = next(line for line in text.splitlines() if line.startswith("| GGUF Q4_0"))
    assert "| 12,800.0 cut (streamed 700.0) | 1.000; cut, streamed: 1.550 |" in q4


def test_a_served_artifact_missing_a_workload_or_its_ratio_is_listed_with_its_card_s_gaps(
    tmp_path: Path,
) -> None:
    """Gaps go by card: the H200's 2048/256 row does not fill the H100's; a windowed row is one."""
    rows = [_row("gptq", "H100", 100.0), _row("awq", "H100", 100.0, ratio=None)]
    other = _with_longer(_row("gptq", "H200", 100.0), {"1": {"output_tokens_per_s": 9.0}})
    text = serving_table.table(
        [
            _write(tmp_path / "h100-2026-12-06-serving.json", rows),
            _write(tmp_path / "h200-2026-12-06-serving.json", [other]),
        ]
    )
    h100 = text[text.index("## H100") : text.index("## H200")].splitlines()
    assert "- GPTQ W4A16 g128 (llm-compressor) in vllm (`gptq`): 2048/256 not served" in h100
    assert (
        "- AWQ W4A16 g128 (llm-compressor) in vllm (`awq`): 2048/256 not served; "
        "no project / raw ratio at 512/128"
    ) in h100
    h200 = text[text.index("## H200") :].splitlines()
    assert (
        "- GPTQ W4A16 g128 (llm-compressor) in vllm (`gptq`): 2048/256 measured over a fixed window only; "
        "no project / raw ratio at 2048/256"
    ) in h200


def test_a_later_run_whose_workload_failed_leaves_the_earlier_row_standing(tmp_path: Path) -> None:
    both = _with_longer(_row("awq", "H100", 100.0), {"1": _level(50.0)})
    first = _write(tmp_path / "h100-2026-12-05-serving.json", [both])
    again = _row("awq", "H100", 200.0)
    _with_longer(again, {})["serving"]["workloads"][-1] |= {"status": "failed", "reason": "server died"}
    later = _write(tmp_path / "h100-2026-12-06-serving-run3.json", [again])
    awq = [line for line in serving_table.table([first, later]).splitlines() if line.startswith("| AWQ")]
    assert len(awq) == 2 and "| 2048/256 | 50.0 |" in awq[1]
    assert awq[1].endswith("| h100-2026-12-05-serving.json |")
    alone = serving_table.table([later])  # no earlier row: the gap names the failed workload's reason
    assert (
        "2048/256 not served (latest failed attempt, "
        "h100-2026-12-06-serving-run3.json: 2048/256: server died)" in alone
    )


def test_a_workload_a_later_benchmark_failed_is_listed_with_that_reason(tmp_path: Path) -> None:
    """2026-12-06, H100: each GGUF's 2048/256 benchmark failed (no request finished at 128 streams);
    the gap says so and why, without the GPU host's log paths, and the 512/128 row stays."""
    first = _row("gguf-q4_0", "H100", 100.0) | {"engine": "llama.cpp"}
    served = _write(tmp_path / "h100-2026-12-06-serving-run2.json", [first])
    failed = {"status": "failed", "reason": "no request succeeded at 128 (0 errored; server log: /tmp/x.log)"}
    again = first | {"serving": failed}
    later = _write(tmp_path / "h100-2026-12-06-serving-run6.json", [again])
    text = serving_table.table([served, later])
    assert (
        "- GGUF Q4_0 in llama.cpp (`gguf-q4_0`): 2048/256 not served (latest failed attempt, "
        "h100-2026-12-06-serving-run6.json: failed: no request succeeded at 128)"
    ) in text.splitlines()
    assert "| GGUF Q4_0 | llama.cpp | 512/128 | 100.0 |" in text
