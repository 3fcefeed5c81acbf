"""llama.cpp's own tools (llama-imatrix, llama-perplexity), run by the llamacpp worker on real GGUF
files of the tiny Llama: the numbers that must hold, and the failures that must be one clear line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.constants import ENV_LLAMACPP
from pipeline.environments import run_step
from pipeline.errors import EngineError
from pipeline.workers.llamacpp import load_imatrix

TEXT = str(Path(__file__).resolve().parent.parent / "pipeline" / "data" / "apache-2.0.txt")
CALIBRATION = str(Path(TEXT).with_name("gpl-3.0.txt"))


def step(request: dict, log: Path) -> dict:
    return run_step(ENV_LLAMACPP, request, log)


@pytest.fixture(scope="module")
def ggufs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama as F16 and as Q4_0 (no imatrix), converted and quantized by llama.cpp."""
    d = tmp_path_factory.mktemp("ggufs")
    f16, q4 = d / "f16.gguf", d / "q4_0.gguf"
    log = d / "log"
    step({"op": "convert", "model_dir": str(tiny_llama), "out_path": str(f16), "outtype": "f16"}, log)
    step({"op": "quantize", "in_path": str(f16), "out_path": str(q4), "quant": "Q4_0"}, log)
    return {"f16": f16, "q4_0": q4}


def make_kld_base(gguf: Path, text: str, out: Path) -> dict:
    """llama-perplexity's log-probabilities of `gguf` over 2 windows of 128 tokens of `text`."""
    request = {"op": "kld_base", "gguf_path": str(gguf), "text_path": text, "ctx": 128, "chunks": 2}
    return step({**request, "out_path": str(out)}, out.with_name("log"))


@pytest.fixture(scope="module")
def kld_base(ggufs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("kld") / "kld-base.bin"
    return out, make_kld_base(ggufs["f16"], TEXT, out)


def imatrix_request(gguf: Path, out: Path, samples: int) -> dict:
    """llama-imatrix over `samples` windows of 64 tokens of the builtin calibration text."""
    return {
        "op": "imatrix",
        "base_path": str(gguf),
        "text_path": CALIBRATION,
        "samples": samples,
        "seq_len": 64,
        "seed": 0,
        "out_path": str(out),
    }


def kld(gguf: Path, base: Path, log: Path) -> dict:
    return step({"op": "kld", "gguf_path": str(gguf), "kld_base_path": str(base), "ctx": 128}, log)


@pytest.mark.slow  # an engine or a build: left out of `make check`
def test_the_f16_file_against_its_own_base_is_zero_and_q4_0_is_not(
    ggufs: dict[str, Path], kld_base: tuple[Path, dict], tmp_path: Path
) -> None:
    base_file, base = kld_base
    assert base["chunks"] == 2 and base["ppl"] > 1
    same = kld(ggufs["f16"], base_file, tmp_path / "log")
    assert same["kld_mean"] == pytest.approx(0.0, abs=1e-4)
    assert same["same_top_p_pct"] == pytest.approx(100.0)
    assert same["ppl"] == pytest.approx(base["ppl"], rel=1e-3)
    assert same["ppl_base"] == pytest.approx(base["ppl"], rel=1e-3)
    q4 = kld(ggufs["q4_0"], base_file, tmp_path / "log")
    assert q4["kld_mean"] > 10 * max(same["kld_mean"], 1e-6)
    assert q4["kld_max"] >= q4["kld_p99"] >= q4["kld_median"] >= 0
    assert q4["ppl_delta_pct"] == pytest.approx(100 * (q4["ppl"] / q4["ppl_base"] - 1))


def test_a_damaged_kl_base_is_one_clear_error(
    ggufs: dict[str, Path], kld_base: tuple[Path, dict], tmp_path: Path
) -> None:
    damaged = tmp_path / "kld-base.bin"
    damaged.write_bytes(kld_base[0].read_bytes()[:5000])
    with pytest.raises(EngineError, match=r"llama-perplexity --kl-divergence .*(failed|no KLD)") as err:
        kld(ggufs["q4_0"], damaged, tmp_path / "log")
    assert "\n" not in str(err.value)


def test_a_text_shorter_than_two_windows_is_refused(ggufs: dict[str, Path], tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.")
    with pytest.raises(EngineError, match="llama-perplexity"):
        make_kld_base(ggufs["f16"], str(short), tmp_path / "kld.bin")


def test_llama_imatrix_covers_every_matmul_input(ggufs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "imatrix.gguf"
    result = step(imatrix_request(ggufs["f16"], out, samples=4), tmp_path / "log")
    assert result["chunks"] == 4 and result["tokens"] == 4 * 64
    rows = step({"op": "inspect", "path": str(ggufs["f16"])}, tmp_path / "log")["rows"]
    values = load_imatrix(str(out))
    blocks = {n for n in rows if n.startswith("blk.")}
    assert blocks <= set(values)  # every block matmul has an importance vector
    for name in blocks:
        assert values[name].shape == (rows[name],)
        assert np.all(values[name] >= 0) and np.any(values[name] > 0)


def test_a_missing_tool_names_the_set_up_step(
    ggufs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A llama.cpp directory without the compiled tools (set-up interrupted): one line saying so."""
    monkeypatch.setenv("PIPELINE_LLAMA_CPP_DIR", str(tmp_path))
    request = imatrix_request(ggufs["f16"], tmp_path / "imatrix.gguf", samples=2)
    with pytest.raises(EngineError, match=r"bin/llama-imatrix missing: run scripts/setup.sh") as err:
        step(request, tmp_path / "log")
    assert "\n" not in str(err.value) and not (tmp_path / "imatrix.gguf").exists()


def test_gated_numbers_that_disagree_with_llama_perplexity_fail_naming_both() -> None:
    """The GGUF verdict's self-check: the same GGUF's PPL through llama-cpp-python and through
    llama-perplexity (same windows and positions) within 1 %, the reference's within 1 % of
    llama-perplexity's on the F16 GGUF; beyond, one reason per disagreement with both numbers."""
    from pipeline.manifest import Metrics
    from pipeline.targets.gguf import disagreements

    def scores(ppl: float, ppl_ref: float) -> Metrics:
        return Metrics(
            ppl=ppl, ppl_ref=ppl_ref, ppl_delta_pct=(ppl / ppl_ref - 1) * 100, top1_agreement=1.0,
            token_agreement=1.0, tokens_per_s=None, prompt_tokens_per_s=None, eval_tokens=1024,
        )  # fmt: skip

    # ppl_base (from the clipped base file) is not what the reference is compared with
    by_llama = {"ppl": 20.0, "ppl_base": 11.0, "ppl_base_run": 16.0}
    assert disagreements(scores(20.15, 16.1), by_llama) == []
    (ppl,) = disagreements(scores(20.3, 16.1), by_llama)
    assert ppl == "the GGUF's PPL 20.3000 disagrees with llama-perplexity's 20.0000 (beyond 1.0%)"
    both = disagreements(scores(21.0, 17.0), by_llama)
    assert len(both) == 2 and "the reference's PPL 17.0000" in both[1] and "16.0000" in both[1]
    assert disagreements(scores(float("nan"), 16.0), by_llama)  # NaN never agrees


# llama-perplexity's output when it stopped after the first chunk (a fresh-clone CI run, exit 0)
_STOPPED = "chunk  PPL ...\n   1    49164.7059 ± 1285.4348 ...\nkl_divergence: 0.20 seconds per pass - ETA\n"
_WHOLE = (
    "Mean PPL(Q)                   :  10.5 ± 0.1\nMean PPL(base)                :  10.0 ± 0.1\n"
    "Mean ln(PPL(Q)/PPL(base))     :   0.048 ± 0.01\nMean    KLD:   0.02 ± 0.001\n"
    "Maximum KLD:   1.5\n99.0%   KLD:   0.3\nMedian  KLD:   0.01\nSame top p:  95.0 ± 0.5 %\n"
    "kl_divergence: computing over 2 chunks\n"
)


def test_a_kld_run_that_stops_without_its_statistics_runs_once_more_then_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pipeline.workers import llamacpp

    outputs = [_STOPPED, _WHOLE]
    monkeypatch.setattr(llamacpp, "_run_tool", lambda cmd, what: outputs.pop(0))
    monkeypatch.setattr(llamacpp, "tool", lambda name: Path(name))
    req = {"gguf_path": "q.gguf", "kld_base_path": "base.bin", "ctx": 128}
    got = llamacpp.op_kld(req)
    assert got["runs"] == 2 and got["kld_mean"] == 0.02 and got["chunks"] == 2 and outputs == []
    outputs[:] = [_STOPPED] * 3
    with pytest.raises(RuntimeError, match=r"printed no PPL\(Q\) in 3 runs: .*ETA"):
        llamacpp.op_kld(req)


def test_a_base_run_that_stops_without_its_estimate_runs_again_then_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The F16 base's run loses its last lines the same way (a fresh-clone CI run, 2026-12-05:
    "[1]49176.5080," and nothing after): run again, and fail naming it after KLD_ATTEMPTS runs."""
    from pipeline.workers import llamacpp

    out = tmp_path / "kld-base.bin"
    stopped = "[1]49176.5080,\nperplexity: 0.49 seconds per pass - ETA\n"
    whole = (
        "calculating perplexity over 2 chunks\n[1]49176.5080,[2]48000.1,\n"
        "Final estimate: PPL = 48500.2 +/- 900.5\n"
    )

    def run(cmd: list[str], what: str) -> str:
        out.write_bytes(b"logits")
        return outputs.pop(0)

    monkeypatch.setattr(llamacpp, "_run_tool", run)
    monkeypatch.setattr(llamacpp, "tool", lambda name: Path(name))
    text = tmp_path / "t.txt"
    text.write_text("some text")
    req = {"gguf_path": "f16.gguf", "text_path": str(text), "ctx": 128, "chunks": 2, "out_path": str(out)}
    outputs = [stopped, whole]
    got = llamacpp.op_kld_base(req)
    assert got == {"ppl": 48500.2, "ppl_stderr": 900.5, "chunks": 2} and outputs == []
    outputs = [stopped] * llamacpp.KLD_ATTEMPTS
    with pytest.raises(RuntimeError, match=r"gave no perplexity in 3 runs: .*ETA"):
        llamacpp.op_kld_base(req)


def test_tools_that_ship_shared_libraries_record_them_in_the_toolchain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU kit's CUDA llama-perplexity keeps its code in libraries beside it: their checksums
    join the tools' in the toolchain; the static tools of scripts/setup.sh add none."""
    import shutil

    from pipeline.workers import llamacpp

    static = llamacpp.op_toolchain({})["toolchain"]
    assert not [k for k in static if k.startswith("lib") and k.endswith("-sha256")]
    copy = tmp_path / "llama.cpp"
    shutil.copytree(llamacpp.llama_cpp_dir(), copy)
    (copy / "bin" / "libllama-common.so.0").write_bytes(b"code")
    monkeypatch.setenv("PIPELINE_LLAMA_CPP_DIR", str(copy))
    shared = llamacpp.op_toolchain({})["toolchain"]
    assert shared.pop("libllama-common.so.0-sha256") == hashlib.sha256(b"code").hexdigest()
    assert shared == static


def test_the_serve_checks_near_ties_are_read_at_each_answer_tokens_own_step() -> None:
    """_top_logprobs: after one pass over prompt + answer, row P-1+j is the distribution answer
    token j was chosen from (llama.cpp's logits_all rows), so each step's top entry is that token."""
    from pipeline.workers.llamacpp import _top_logprobs

    prompt, answer = [5, 6, 7], [2, 3]
    rows = np.zeros((len(prompt) + len(answer), 10), dtype=np.float32)
    for i, best in enumerate([9, 9, 2, 3, 9]):  # row 2 (after the prompt's last token) chose 2, ...
        rows[i, best] = 4.0
        rows[i, 8] = 3.95  # a near-tie, 0.05 below

    class Logits:
        scores: np.ndarray

        def reset(self) -> None:
            self.scores = np.empty((0, 10))

        def eval(self, ids: list[int]) -> None:
            self.scores = rows[: len(ids)]

    top = _top_logprobs(Logits(), prompt, answer)
    assert [max(step, key=lambda t: step[t]) for step in top] == ["2", "3"]
    assert all(len(step) == 5 and max(step.values()) < 0 for step in top)
    assert top[0]["2"] - top[0]["8"] == pytest.approx(0.05, abs=1e-5)
    assert _top_logprobs(Logits(), prompt, []) == []


def test_llama_cpps_threads_follow_the_request_then_the_openmp_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pipeline.workers.llamacpp import _threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _threads({"threads": 2}) == 2 and _threads({"threads": 0}) == 3 and _threads({}) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert _threads({}) == (os.cpu_count() or 1)


def _overhead(gguf: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "llama_decode_overhead.py"
    argv = [sys.executable, str(script), str(gguf), "--parallel", "1,2", "--prompt-tokens", "16",
            "--output-tokens", "8", "--threads", "1", "--json", str(tmp_path / "o.json"), *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow  # llama-batched-bench and llama-server on the tiny Llama
def test_llama_server_is_timed_beside_llama_batched_bench_and_a_server_that_cannot_start_is_one_line(
    ggufs: dict[str, Path], tmp_path: Path
) -> None:
    """benchmarks/llama_decode_overhead.py: both sides measured at each parallel count, their ratio
    the server's step time over the engine's; a llama-server that exits names itself, a missing GGUF
    is named, a truncated one stops at the engine's own error."""
    run = _overhead(ggufs["q4_0"], tmp_path)
    assert run.returncode == 0, run.stderr
    levels = json.loads((tmp_path / "o.json").read_text())["levels"]
    assert sorted(levels) == ["1", "2"]
    for lv in levels.values():
        assert lv["engine_step_ms"] > 0 and lv["server_step_ms"] > 0
        assert lv["server_over_engine"] == pytest.approx(lv["server_step_ms"] / lv["engine_step_ms"])
    assert "| 2 |" in run.stdout
    bad = _overhead(ggufs["q4_0"], tmp_path, "--server-arg=--no-such-flag")
    assert bad.returncode != 0 and bad.stderr.startswith("error: llama-server: the server exited with code 1")
    assert "--no-such-flag" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    gone = _overhead(tmp_path / "none.gguf", tmp_path)
    assert gone.returncode != 0 and "no such GGUF file" in gone.stderr
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(ggufs["q4_0"].read_bytes()[:300])
    broken = _overhead(cut, tmp_path)
    assert broken.returncode != 0 and broken.stderr.startswith("error: llama-batched-bench exited 1: ")


@pytest.mark.slow  # three llama-servers on the tiny Llama
def test_idle_slot_saves_are_counted_per_server_setting_and_a_missing_gguf_is_one_line(
    ggufs: dict[str, Path], tmp_path: Path
) -> None:
    """benchmarks/llama_idle_slots.py: llama.cpp's cache with idle slots saved (a 1 MiB cap, too
    small for the eight slots' 450-token states, so new tasks evict: 41 evictions against 7), the same without
    those saves (evicting only for the slot a task takes), and no cache (no eviction at all); each
    setting's time outside the server's own work is measured."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "llama_idle_slots.py"

    def run(gguf: Path) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, str(script), str(gguf), "--slots", "8", "--prompt-tokens", "448",
                "--output-tokens", "4", "--requests", "3", "--cache-ram", "1",
                "--json", str(tmp_path / "i.json")]  # fmt: skip
        return subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)

    done = run(ggufs["q4_0"])
    assert done.returncode == 0, done.stderr
    saved, unsaved, off = json.loads((tmp_path / "i.json").read_text())["settings"].values()
    assert saved["server_args"] == ["--cache-ram", "1"] and off["server_args"] == ["--cache-ram", "0"]
    assert saved["evictions"] > unsaved["evictions"] and off["evictions"] == 0
    assert all(s["sequential_outside_ms_median"] >= 0 for s in (saved, unsaved, off))
    assert "| no RAM cache (--cache-ram 0) |" in done.stdout
    gone = run(tmp_path / "none.gguf")
    assert gone.returncode != 0 and gone.stderr.strip().endswith("no such GGUF file")
    assert len(gone.stderr.strip().splitlines()) == 1
