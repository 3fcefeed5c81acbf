"""Worker requests are typed (pipeline.workers.requests): a misspelt or missing key fails at once,
naming it, in the core before the step starts and in the worker on arrival."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from pipeline.environments import check_step_request, environment, run_step
from pipeline.errors import EngineError
from pipeline.workers.requests import REPLIES, REQUESTS, check_reply, check_request

ROOT = Path(__file__).resolve().parent.parent


def test_every_op_a_worker_dispatches_has_a_request_model() -> None:
    for module, ops in REQUESTS.items():
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        dispatched = set(re.findall(r'"([a-z_]+)": op_', source[source.index("worker_main(") :]))
        assert dispatched == set(ops), module


def test_a_misspelt_key_fails_in_the_core_naming_it() -> None:
    good = {
        "op": "validate", "model_dir": "/m", "dtype": "bfloat16", "reference": {}, "reference_dir": "/r",
        "max_new_tokens": 8, "gpu_memory_utilization": 0.5,
    }  # fmt: skip
    check_step_request("vllm", good)
    bad = {**good, "gpu_memory_utilisation": 0.5}
    del bad["gpu_memory_utilization"]
    with pytest.raises(EngineError) as caught:
        check_step_request("vllm", bad)
    message = str(caught.value)
    assert message.startswith("pipeline.workers.vllm validate request: ")
    assert "gpu_memory_utilization: field required" in message
    assert "gpu_memory_utilisation: not a field of this op" in message
    assert "\n" not in message
    with pytest.raises(ValueError, match=r"max_new_tokens: input should be a valid integer"):
        check_request("pipeline.workers.vllm", {**good, "max_new_tokens": "eight"})


def test_a_misspelt_key_fails_in_the_worker_naming_it(tmp_path: Path) -> None:
    """The real llama.cpp worker (the core's own environment) refuses the request on arrival."""
    assert environment("llamacpp").exists
    with pytest.raises(EngineError) as caught:
        run_step("llamacpp", {"op": "inspect", "pth": "/x.gguf"}, tmp_path / "log")
    assert "pipeline.workers.llamacpp inspect request: path: field required; pth: not a field" in str(
        caught.value
    )


def test_an_op_without_a_model_is_not_checked() -> None:
    check_request("pipeline.workers.vllm", {"op": "no-such-op", "anything": 1})
    check_request("some.other.worker", {"op": "validate"})


def test_every_reply_model_names_an_op_the_worker_dispatches() -> None:
    for module, ops in REPLIES.items():
        assert set(ops) <= set(REQUESTS[module]), module


def test_a_reply_missing_what_the_core_reads_fails_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose reply lacks a field the core reads (here: a stand-in interpreter whose
    llama.cpp worker answers `inspect` without `rows`) fails the step in one line naming it, not as a
    KeyError later; the worker's own check says the same before it writes the reply."""
    check_reply(
        "pipeline.workers.llamacpp",
        "inspect",
        {"architecture": "llama", "tensor_types": {}, "rows": {}, "tensor_bytes": {}},
    )
    with pytest.raises(ValueError, match=r"pipeline.workers.llamacpp inspect reply: rows: field required$"):
        check_reply(
            "pipeline.workers.llamacpp",
            "inspect",
            {"architecture": "llama", "tensor_types": {}, "tensor_bytes": {}},
        )
    with pytest.raises(ValueError, match=r"vllm validate reply: .*startup_s: input should be a valid number"):
        check_reply("pipeline.workers.vllm", "validate", {"ppl": 1.0, "startup_s": "soon"})
    check_reply("pipeline.workers.vllm", "validate", {"error": "the engine crashed"})  # errors pass through
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        'if grep -q \'"op": "inspect"\' "$3"; then\n'
        '  echo \'{"architecture": "llama", "tensor_types": {}}\' > "$4"; exit 0\n'
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PIPELINE_LLAMACPP_PYTHON", str(fake))
    with pytest.raises(EngineError) as caught:
        run_step("llamacpp", {"op": "inspect", "path": "/x.gguf"}, tmp_path / "log")
    assert str(caught.value).startswith("pipeline.workers.llamacpp inspect reply: rows: field required")
    assert "a defect of the pipeline" in str(caught.value)
