"""Serve commands as the manifest records them: run by a deploy job's shell, every value arrives
as one argument and nothing in a value runs (pipeline.engines.serving.command_line), and the serve
check's worker reads them back the same way (pipeline.workers.serving.serve_argv)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline.engines.serving import ARTIFACT_DIR, command_line
from pipeline.workers.serving import serve_argv


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
    # the serve check's worker substitutes after splitting: a path with spaces stays one argument
    served = command_line(
        ["python", "-m", "m", "--model", f"{ARTIFACT_DIR}/m.gguf", "--host", "h", "--port", "1"]
    )
    assert serve_argv(served, "/a b", 5, python="py") == [
        "py",
        "-m",
        "m",
        "--model",
        "/a b/m.gguf",
        "--host",
        "127.0.0.1",
        "--port",
        "5",
    ]
