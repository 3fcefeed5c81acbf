"""`pipeline build --cluster` on real Ray clusters of this machine: a multi-node one
(`ray.cluster_utils.Cluster`, nodes advertising different environments) and the in-process `local`
one. Tiny-model GGUF targets; the builds are real, placement is by the resources nodes advertise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
# a GPU host need not have Ray: this module then skips instead of failing `pytest -m gpu`'s collection
ray = pytest.importorskip("ray", reason="Ray is not installed (pipeline build --cluster needs it)")
from ray.cluster_utils import Cluster  # noqa: E402

from pipeline.cluster import (  # noqa: E402
    INCOMING_DIRNAME,
    RESOURCE_ENV,
    RESOURCE_SLOT,
    build_on_cluster,
    node_resources,
)
from pipeline.constants import MANIFEST_NAME, STAGING_PREFIX  # noqa: E402
from pipeline.project import Project  # noqa: E402
from pipeline.registry import Registry  # noqa: E402
from tests.conftest import REPO, read_json, write_recipe  # noqa: E402

GGUF = {"kind": "gguf", "quant": "F16", "gates": {"max_ppl_delta_pct": 0.1, "max_kld_mean": 0.001}}
Q8 = {"kind": "gguf", "quant": "Q8_0", "gates": {"max_ppl_delta_pct": 5.0, "max_kld_mean": 0.05}}
TRTLLM = {"kind": "trtllm", "quant": "fp16", "gpu_arch": "sm90",
          "gates": {"max_ppl_delta_pct": 1.0, "max_kld_mean": 0.01}}  # fmt: skip
CAN_GGUF = {RESOURCE_SLOT: 1, RESOURCE_ENV + "transformers": 1, RESOURCE_ENV + "llamacpp": 1}
CPU_ONLY = {RESOURCE_SLOT: 1, RESOURCE_ENV + "transformers": 1}  # lacks llama.cpp's environment


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, dict[str, str]]]:
    """A head node that builds nothing and three nodes: two that can build GGUF, one that cannot.
    They share this host's workspace under PIPELINE_NODE_WORKSPACE."""
    workspace = tmp_path_factory.mktemp("node-workspaces")
    old = os.environ.get("PIPELINE_NODE_WORKSPACE")
    os.environ["PIPELINE_NODE_WORKSPACE"] = str(workspace)  # the nodes' processes inherit it
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = {}
    for label, resources in (("gguf-a", CAN_GGUF), ("cpu-only", CPU_ONLY), ("gguf-b", CAN_GGUF)):
        node = c.add_node(num_cpus=1, resources=resources)
        nodes[node.node_id] = label
    c.wait_for_nodes()
    yield c, nodes
    c.shutdown()
    if old is None:
        os.environ.pop("PIPELINE_NODE_WORKSPACE", None)
    else:
        os.environ["PIPELINE_NODE_WORKSPACE"] = old


def _recipe(recipe_dir: Path, **targets: dict) -> Path:
    return write_recipe(recipe_dir / "tiny.yaml", targets=targets)


def _no_leftovers(recipe_root: Path) -> None:
    incoming = recipe_root / INCOMING_DIRNAME
    assert not incoming.exists() or list(incoming.iterdir()) == []
    assert not [p for p in recipe_root.iterdir() if p.name.startswith(STAGING_PREFIX)]


def test_targets_land_on_nodes_that_advertise_their_environments(
    cluster: tuple[Cluster, dict[str, str]], tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    c, nodes = cluster
    recipe = _recipe(tiny_recipe_dir, **{"gguf-f16": GGUF, "gguf-q8_0": Q8, "trt-fp16": TRTLLM})
    project = Project.open(recipe)
    results = {r.target: r for r in build_on_cluster(project, c.address)}

    trt = results["trt-fp16"]
    assert trt.outcome == "unavailable" and trt.validation == "unavailable"
    assert "no node advertises pipeline-env-modelopt, pipeline-env-trtllm, pipeline-gpu-sm90" in trt.message
    root = _isolated_artifacts / "tiny"
    for name in ("gguf-f16", "gguf-q8_0"):
        r = results[name]
        assert r.outcome == "built" and r.validation == "passed", r
        manifest = read_json(root / name / MANIFEST_NAME)
        assert nodes[manifest["build"]["node"]] in ("gguf-a", "gguf-b"), manifest["build"]  # never cpu-only
        assert manifest["build"]["host"] and r.host and manifest["build"]["node"][:12] in r.host
    registry = Registry(_isolated_artifacts)
    assert registry.resolve("tiny", "llama.cpp", "F16")["status"] == "passed"
    assert registry.verify("tiny/gguf-f16") == [] and registry.verify("tiny/gguf-q8_0") == []
    assert (project.layout.reference_dir / "reference.json").is_file()  # the shared step, in the root
    _no_leftovers(root)

    # A plain build on the driver finds exactly what it would have built: the same inputs.
    again = {r.target: r.outcome for r in project.build(["gguf-f16", "gguf-q8_0"])}
    assert again == {"gguf-f16": "up-to-date", "gguf-q8_0": "up-to-date"}
    # ... and so does the cluster, without building anything.
    twice = {r.target: r.outcome for r in build_on_cluster(project, c.address, ["gguf-f16"])}
    assert twice == {"gguf-f16": "up-to-date"}
    assert [p.name for p in (root / ".versions" / "gguf-f16").iterdir()] == ["1"]

    # Only the deploy command moved: the node keeps the shared root's files, as a plain build does.
    before = read_json(root / "gguf-q8_0" / MANIFEST_NAME)
    targets = {"gguf-f16": GGUF, "gguf-q8_0": Q8, "trt-fp16": TRTLLM}
    write_recipe(recipe, targets=targets, serve={"llamacpp": {"parallel": 2}})
    [kept] = build_on_cluster(Project.open(recipe), c.address, ["gguf-q8_0"])
    assert kept.outcome == "built" and kept.validation == "passed", kept
    assert f"files kept from the build of {before['build']['finished_at']}" in kept.message
    after = read_json(root / "gguf-q8_0" / MANIFEST_NAME)
    assert after["files"] == before["files"] and "-np 2" in after["serve"]["command"]
    assert after["build"]["bytes_from"]["inputs_sha256"] == before["build"]["inputs_sha256"]
    assert not {"convert", "quantize"} & {s["op"] for s in after["build"]["steps"]}
    _no_leftovers(root)


def test_a_killed_build_task_is_retried_on_another_node_and_the_registry_loses_nothing(
    cluster: tuple[Cluster, dict[str, str]], tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    c, nodes = cluster
    recipe = _recipe(tiny_recipe_dir, **{"gguf-f16": GGUF})
    build = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "build", str(recipe), "--cluster", c.address],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    incoming = _isolated_artifacts / "tiny" / INCOMING_DIRNAME
    workspace = Path(os.environ["PIPELINE_NODE_WORKSPACE"])
    killed = None
    deadline = time.monotonic() + 240
    while killed is None and time.monotonic() < deadline and build.poll() is None:
        for marker in incoming.glob("gguf-f16--*.running") if incoming.is_dir() else []:
            task = json.loads(marker.read_text())
            staging = Path(task["workspace"]) / "tiny"
            if any(p.name.startswith(f"{STAGING_PREFIX}gguf-f16-") for p in staging.glob(".*")):
                os.kill(task["pid"], signal.SIGKILL)  # mid-build: its staging directory exists
                killed = task["node"]
                break
        time.sleep(0.2)
    out, _ = build.communicate(timeout=600)
    assert killed is not None, f"the task was never seen building:\n{out}"
    assert build.returncode == 0, out
    manifest = read_json(_isolated_artifacts / "tiny" / "gguf-f16" / MANIFEST_NAME)
    assert manifest["build"]["node"] != killed and nodes[manifest["build"]["node"]] in ("gguf-a", "gguf-b")
    assert manifest["validation"]["status"] == "passed"
    registry = Registry(_isolated_artifacts)
    assert [h.version for h in registry.history("tiny/gguf-f16")] == [1]  # the dead attempt: nothing
    assert registry.verify("tiny/gguf-f16") == []
    assert "built on" in out and manifest["build"]["node"][:12] in out
    _no_leftovers(_isolated_artifacts / "tiny")
    # this run and the previous test's, on three nodes of one host: one workspace, whose temporaries
    # (the killed task's staging directory) are gone and whose F16 base was made once
    [host] = workspace.iterdir()
    assert host == Path(task["workspace"]) and not list(host.glob(f"tiny/{STAGING_PREFIX}*"))
    assert sorted(p.name for p in host.glob("tiny/.cache/*")) == ["gguf-base-f16", "gguf-kld-base-f16"]


def test_an_unreachable_cluster_is_one_line_and_builds_nothing(
    tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    recipe = _recipe(tiny_recipe_dir, **{"gguf-q8_0": Q8})
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "build", str(recipe), "--cluster", "127.0.0.1:9"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 5, done.stdout + done.stderr
    assert "cannot join the Ray cluster at '127.0.0.1:9'" in done.stderr
    assert not (_isolated_artifacts / "tiny" / "gguf-q8_0").exists()


def test_a_cluster_build_refuses_a_split_no_engine_can_load_as_a_plain_build_does(
    tiny_recipe_dir: Path, _isolated_artifacts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a node too: a target whose own tp_size the tiny Llama's 2 heads do not allow is a recipe
    error (exit 2) naming the dimension, and no step of it runs there."""
    monkeypatch.setenv("PIPELINE_NODE_WORKSPACE", str(tmp_path / "nodes"))
    awq = {"kind": "awq", "group_size": 64, "gates": {"max_ppl_delta_pct": 1e6, "max_kld_topk_mean": 100},
           "tp_size": 3}  # fmt: skip
    recipe = _recipe(tiny_recipe_dir, wide=awq)
    [result] = build_on_cluster(Project.open(recipe), "local", ["wide"])
    assert result.outcome == "error" and result.exit_code == 2, result.message
    assert "targets.wide: no engine can load it: vllm [tp-divides-heads] tp_size 3" in (result.message or "")
    assert not list((tmp_path / "nodes").glob("*/tiny/.logs/wide*.log"))
    # the local node ended with the build: none of its marked processes and no watcher is left
    mine = f"PIPELINE_LOCAL_CLUSTER={os.getpid()}-".encode()
    left = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            environ, cmdline = (proc / "environ").read_bytes(), (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if any(v.startswith(mine) for v in environ.split(b"\0")) or cmdline.startswith(
            f"{sys.executable}\0-m\0pipeline.reaper\0{os.getpid()}\0".encode()
        ):
            left.append(proc.name)
    assert not left, f"left after the build: {left}"


def test_dvc_repro_builds_its_stage_on_a_local_cluster_advertising_this_host(
    tiny_recipe_dir: Path, _isolated_artifacts: Path, tmp_path: Path
) -> None:
    """DVC stays the front door: a stage's `pipeline build` reads PIPELINE_CLUSTER (here `local`: a
    node started in that process with this host's resources); the driver writes dvc.lock over what
    the cluster built into its artifacts root, and a plain build finds it up to date."""
    resources = json.loads(
        subprocess.run(
            [sys.executable, "-m", "pipeline", "cluster", "resources", "--slots", "2"],
            cwd=REPO, capture_output=True, text=True, check=True,
        ).stdout
    )  # fmt: skip
    assert resources == node_resources(2) and resources[RESOURCE_SLOT] == 2
    assert {RESOURCE_ENV + "llamacpp", RESOURCE_ENV + "transformers"} <= resources.keys()

    project_dir = _isolated_artifacts.parent
    recipe = _recipe(tiny_recipe_dir, **{"gguf-q8_0": Q8})
    stage = {
        "cmd": f"{sys.executable} -m pipeline build recipes/tiny.yaml --targets gguf-q8_0",
        "deps": ["recipes/tiny.yaml"],
        "outs": [{"artifacts/tiny/gguf-q8_0": {"cache": False}}],
    }
    (project_dir / "dvc.yaml").write_text(json.dumps({"stages": {"build-tiny-gguf-q8_0": stage}}))
    dvc = Path(sys.executable).with_name("dvc")
    env = {**os.environ, "PIPELINE_CLUSTER": "local", "PIPELINE_NODE_WORKSPACE": str(tmp_path / "nodes")}
    subprocess.run([dvc, "init", "--no-scm", "-q"], cwd=project_dir, check=True, env=env)
    done = subprocess.run([dvc, "repro"], cwd=project_dir, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    manifest = read_json(_isolated_artifacts / "tiny" / "gguf-q8_0" / MANIFEST_NAME)
    assert manifest["build"]["node"] and manifest["validation"]["status"] == "passed"
    assert "built on" in done.stdout
    assert "artifacts/tiny/gguf-q8_0" in (project_dir / "dvc.lock").read_text()
    status = subprocess.run([dvc, "status"], cwd=project_dir, capture_output=True, text=True, env=env)
    assert "up to date" in status.stdout, status.stdout
    assert [r.outcome for r in Project.open(recipe).build()] == ["up-to-date"]


DRIVER = """
import sys, time
from pipeline.cluster import connect
print(connect("local").value, flush=True)
time.sleep(300)
"""


def test_a_killed_local_driver_leaves_none_of_its_nodes_processes(tmp_path: Path) -> None:
    """`kill -9` of a `--cluster local` driver: its GCS and raylet die with it, and the watcher
    ends the rest (Ray's dashboard and runtime-env agents alone lived on for ~75 s), marked
    processes only: an unmarked process of the same name lives."""
    from pipeline.reaper import marked

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        assert driver.stdout is not None
        mark = driver.stdout.readline().strip()
        assert mark, "the driver printed no mark"
        deadline = time.monotonic() + 30
        while len(marked(mark)) < 3:  # GCS, raylet and the agents start one after another
            assert time.monotonic() < deadline, f"marked after 30 s: {marked(mark)}"
            time.sleep(0.2)
        names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in marked(mark)}
        assert {"gcs_server", "raylet"} <= names, names
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        deadline = time.monotonic() + 15
        while left := marked(mark):
            assert time.monotonic() < deadline, f"still alive 15 s after the driver: {left}"
            time.sleep(0.2)
        assert stranger.poll() is None
    finally:
        driver.kill()
        stranger.kill()
        stranger.wait()
