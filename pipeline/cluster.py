"""`pipeline build RECIPE --cluster ADDRESS`: one Ray task per target, on a node that can build it.

Placement. A node says what it can build with Ray custom resources (`pipeline cluster resources`
prints this host's, for `ray start --resources`): `pipeline-env-<environment>` for each step
environment it has, `pipeline-gpu-<arch>` for its GPU and `pipeline-build-slot` for how many
builds it runs at once. A target's task asks for the environments it needs, the GPU architecture
an engine is tied to and one slot; a target no live node advertises all of is `unavailable`.

Bytes. The artifacts root is the shared storage: a filesystem every node mounts at the same path
(NFS, a KubeRay volume). A task builds in its host's workspace, copies the complete artifact
into `<root>/<recipe>/.incoming/` under a temporary name, renames it when complete and returns
only the manifest. The driver checks the files against it and records the version exactly as a
plain build does (it is the registry's one writer). Shared steps (source, reference) run once, in
one task, into the shared root; build tasks copy the reference into their workspace.

Failure. A task whose worker process or node dies is submitted again, to another eligible node
while one is alive (at most RETRIES times); a build error is a result and is not retried. What a
dead task left in `.incoming/` is deleted by the driver; nothing half-copied is ever published.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline import reaper
from pipeline.artifacts import build_lock, cached_step, read_key, remove_path, sweep_leftovers, verify_files
from pipeline.constants import ENV_GUIDELLM, ENV_TRANSFORMERS, STATUS_UNAVAILABLE
from pipeline.context import NullReporter, Reporter
from pipeline.environments import ENVIRONMENTS, local_gpu_arch
from pipeline.errors import BuildError, EngineError, PipelineError
from pipeline.manifest import Manifest
from pipeline.project import Project, TargetResult, kept_note
from pipeline.targets import Target
from pipeline.workers.protocol import is_disk_full

RESOURCE_ENV = "pipeline-env-"
RESOURCE_GPU = "pipeline-gpu-"
RESOURCE_SLOT = "pipeline-build-slot"
ENV_SHARE = 0.01  # what a task takes of an environment resource: environments never run out, slots do
RETRIES = 2  # further attempts after a task's worker or node died
INCOMING_DIRNAME = ".incoming"
POLL_S = 10.0  # how often the driver looks for targets that lost every node able to build them


def node_resources(slots: int = 1) -> dict[str, float]:
    """The custom resources this host advertises: its step environments, its GPU, its build slots."""
    resources = {RESOURCE_SLOT: float(slots)}
    resources |= {RESOURCE_ENV + name: 1.0 for name, env in ENVIRONMENTS.items() if env.exists}
    if (arch := local_gpu_arch()) is not None:
        resources[RESOURCE_GPU + arch] = 1.0
    return resources


def requirements(project: Project, name: str, spec: Target) -> dict[str, float]:
    """What a node must advertise to build target `name`: the environments it builds and validates
    in, the reference's, the load generator's when the recipe benchmarks it, its GPU architecture,
    a slot."""
    envs = {*spec.environments, *spec.recorded_environments(), ENV_TRANSFORMERS}
    if project.loaded.recipe.serving_benchmark.benchmarks(name):
        envs.add(ENV_GUIDELLM)
    need = {RESOURCE_ENV + env: ENV_SHARE for env in sorted(envs)}
    if (arch := spec.build_gpu_arch()) is not None:
        need[RESOURCE_GPU + arch] = ENV_SHARE
    return need | {RESOURCE_SLOT: 1.0}


@dataclass(frozen=True)
class Node:
    node_id: str
    host: str
    resources: dict[str, float]

    def can_build(self, need: dict[str, float]) -> bool:
        return all(self.resources.get(key, 0.0) >= amount for key, amount in need.items())


def live_nodes() -> list[Node]:
    return [
        Node(n["NodeID"], n.get("NodeManagerHostname", "?"), n.get("Resources", {}))
        for n in ray.nodes()
        if n.get("Alive")
    ]


def why_no_node(need: dict[str, float], nodes: list[Node]) -> str:
    """The reason a target is unavailable on this cluster: the resources no node advertises."""
    missing = sorted(k for k in need if not any(k in n.resources for n in nodes))
    what = (
        f"no node advertises {', '.join(missing)}"
        if missing
        else f"no single node advertises all of {', '.join(sorted(need))}"
    )
    return (
        f"no live node of the Ray cluster ({len(nodes)} alive) can build it: {what} "
        '(`ray start --resources "$(pipeline cluster resources)"` on a host that has them)'
    )


def connect(address: str) -> reaper.Watched | None:
    """Join the cluster at `address` (`auto`: the `ray start` cluster of this host), or start one
    in this process (`local`) that advertises this host's resources. A local node's processes carry
    a mark that pipeline.reaper ends them by when this process is gone (returned: `end()` them when
    done), or at once when the start fails."""
    host, _, port = address.rpartition(":")
    if host and port.isdigit() and "://" not in address:  # Ray itself would retry for minutes
        try:
            socket.create_connection((host, int(port)), timeout=10).close()
        except OSError as exc:
            raise EngineError(
                f"cannot join the Ray cluster at {address!r}: nothing answers there ({exc.strerror or exc}); "
                "start its head with `ray start --head`"
            ) from None
    watched, outer = None, os.environ.get(reaper.MARK)
    try:
        if address == "local":
            # inherited by the node Ray starts, not by what this process starts after
            os.environ[reaper.MARK] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
            watched = reaper.watch_this_process(os.environ[reaper.MARK])
            ray.init(
                address="local", resources=node_resources(), include_dashboard=False,
                log_to_driver=False, configure_logging=False,
            )  # fmt: skip
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        if watched is not None:  # what the failed start left (a GCS) ends now
            watched.end()
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise EngineError(f"cannot join the Ray cluster at {address!r}: {first}") from None
    finally:
        if outer is None:
            os.environ.pop(reaper.MARK, None)
        else:  # this process belongs to an outer local node: keep its mark
            os.environ[reaper.MARK] = outer
    return watched


@dataclass
class _Attempt:
    """One submission of a target's task; a retry is the next number with a new token."""

    name: str
    need: dict[str, float]  # the resources its node must advertise
    inputs: str | None  # the inputs hash of the driver's current artifact (None: build anyway)
    number: int
    token: str
    submitted: float
    failed_nodes: set[str] = field(default_factory=set)


class ClusterBuild:
    """One `pipeline build --cluster`: the driver's side (placement, retries, recording)."""

    def __init__(self, project: Project, reporter: Reporter | None = None, threads: int = 0) -> None:
        self.project = project
        self.reporter = reporter or NullReporter()
        self.threads = threads
        self.incoming = project.layout.recipe_dir / INCOMING_DIRNAME

    def run(self, names: list[str] | None, force: bool) -> list[TargetResult]:
        """Build the selected targets on the connected cluster; results in the recipe's order."""
        specs = self.project.select(names)
        sweep_leftovers(self.project.layout)
        results: dict[str, TargetResult] = {}
        with contextlib.ExitStack() as held:
            for name in specs:  # a plain build of the same target waits for this one, and vice versa
                held.enter_context(build_lock(self.project.layout, name))
            self._clear_incoming(specs)
            nodes = live_nodes()
            runnable = {}
            for name, spec in specs.items():
                need = requirements(self.project, name, spec)
                if any(n.can_build(need) for n in nodes):
                    runnable[name] = (spec, need)
                else:
                    results[name] = self._unavailable(name, why_no_node(need, nodes))
            if runnable:
                self._prepare_shared_steps()
                results |= self._build_all(runnable, force)
        return [results[name] for name in specs]

    def _clear_incoming(self, specs: dict[str, Target]) -> None:
        """What earlier, killed drivers left in `.incoming/` for these targets (their locks are ours)."""
        if self.incoming.is_dir():
            for path in self.incoming.iterdir():
                if path.name.split("--")[0] in specs:
                    remove_path(path)

    def _prepare_shared_steps(self) -> None:
        """Source record and reference, once, into the shared root, on a node with transformers."""
        self.reporter.step("reference", "source and reference on the cluster")
        need = {RESOURCE_ENV + ENV_TRANSFORMERS: ENV_SHARE, RESOURCE_SLOT: 1.0}
        task = ray.remote(_prepare_task).options(
            resources=need, num_cpus=0, max_retries=RETRIES, name="pipeline-shared-steps"
        )
        try:
            ray.get(task.remote(str(self.project.loaded.path), str(self.project.layout.root)))
        except RayTaskError as exc:
            raise BuildError(f"the shared steps failed on the cluster: {_first_line(exc)}") from None
        except RayError as exc:
            raise EngineError(f"the shared steps' task died on the cluster: {_first_line(exc)}") from None

    def _build_all(
        self, runnable: dict[str, tuple[Target, dict[str, float]]], force: bool
    ) -> dict[str, TargetResult]:
        results: dict[str, TargetResult] = {}
        pending: dict[Any, _Attempt] = {}
        for name, (_, need) in runnable.items():
            previous = None if force else self.project.current_manifest(name)
            inputs = previous.build.inputs_sha256 if previous else None
            attempt = _Attempt(name, need, inputs, 1, uuid.uuid4().hex[:12], time.perf_counter())
            pending[self._submit(attempt, force)] = attempt
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            if not ready:
                self._give_up_on_orphans(pending, results)
                continue
            ref = ready[0]
            attempt = pending.pop(ref)
            name = attempt.name
            try:
                out = ray.get(ref)
            except RayTaskError as exc:  # the task raised something unexpected: not retried
                results[name] = self._error(attempt, BuildError(f"{name}: {_first_line(exc)}"))
                continue
            except RayError as exc:  # its worker process or its node died
                node = self._attempt_node(attempt)
                self._clean(attempt)
                if node:
                    attempt.failed_nodes.add(node)
                if attempt.number > RETRIES:
                    message = f"{name}: the build task died {attempt.number} times (last: {_first_line(exc)})"
                    results[name] = self._error(attempt, EngineError(message))
                    continue
                self.reporter.step(name, f"task died on node {node[:12] if node else '?'}; trying again")
                retry = replace(attempt, number=attempt.number + 1, token=uuid.uuid4().hex[:12])
                pending[self._submit(retry, force)] = retry
                continue
            results[name] = self._record(attempt, runnable[name][0], out)
        return results

    def _submit(self, attempt: _Attempt, force: bool) -> Any:
        """Start one attempt; a retry goes to an eligible node that has not failed it, if any."""
        options: dict[str, Any] = {"resources": attempt.need, "num_cpus": 0, "max_retries": 0,
                                   "name": f"pipeline-build-{attempt.name}"}  # fmt: skip
        others = [
            n for n in live_nodes() if n.can_build(attempt.need) and n.node_id not in attempt.failed_nodes
        ]
        if attempt.failed_nodes and others:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(others[0].node_id, soft=True)
        self.reporter.step(attempt.name, f"submitted to the cluster (attempt {attempt.number})")
        return ray.remote(_build_task).options(**options).remote(
            str(self.project.loaded.path), str(self.project.layout.root), attempt.name, attempt.inputs, force,
            f"{attempt.name}--{attempt.token}", self.threads,
        )  # fmt: skip

    def _give_up_on_orphans(self, pending: dict[Any, _Attempt], results: dict[str, TargetResult]) -> None:
        """Cancel waiting tasks that no live node can take any more (their nodes left)."""
        nodes = live_nodes()
        for ref, attempt in list(pending.items()):
            if not any(n.can_build(attempt.need) for n in nodes) and not self._attempt_node(attempt):
                ray.cancel(ref, force=True)
                del pending[ref]
                why = why_no_node(attempt.need, nodes)
                results[attempt.name] = self._unavailable(attempt.name, why, attempt.submitted)

    def _attempt_node(self, attempt: _Attempt) -> str | None:
        """The node an attempt started on (its marker), None before it started."""
        try:
            marker = self.incoming / f"{attempt.name}--{attempt.token}.running"
            return json.loads(marker.read_text())["node"]
        except (OSError, ValueError, KeyError):
            return None

    def _clean(self, attempt: _Attempt) -> None:
        for path in self.incoming.glob(f"{attempt.name}--{attempt.token}*"):
            remove_path(path)

    def _unavailable(self, name: str, why: str, submitted: float | None = None) -> TargetResult:
        seconds = time.perf_counter() - submitted if submitted is not None else 0.0
        return TargetResult(
            name, STATUS_UNAVAILABLE, self.project.layout.target_dir(name), validation=STATUS_UNAVAILABLE,
            message=why, seconds=seconds,
        )  # fmt: skip

    def _error(self, attempt: _Attempt, exc: PipelineError) -> TargetResult:
        self._clean(attempt)
        return TargetResult(
            attempt.name, "error", self.project.layout.target_dir(attempt.name), message=str(exc),
            exit_code=exc.exit_code, seconds=time.perf_counter() - attempt.submitted,
        )  # fmt: skip

    def _record(self, attempt: _Attempt, spec: Target, out: dict[str, Any]) -> TargetResult:
        """What a task returned: its artifact checked and recorded, or its outcome as it is."""
        name = attempt.name
        seconds = time.perf_counter() - attempt.submitted
        try:
            if out["outcome"] == "error":
                return self._error(attempt, _error_of(out))
            if out["outcome"] == STATUS_UNAVAILABLE:
                self._clean(attempt)
                return self._unavailable(name, out["message"], attempt.submitted)
            if out["outcome"] == "up-to-date":
                self._clean(attempt)
                result = self.project.up_to_date(name, spec)
            else:
                manifest = Manifest.model_validate(out["manifest"])
                arrived = Path(out["dir"])
                problems = verify_files(arrived, manifest.files)
                if problems:
                    damage = "; ".join(problems[:3])
                    raise BuildError(f"{name}: the artifact arrived damaged from its node: {damage}")
                result = self.project.record(name, spec, arrived, manifest)
                result.message = "; ".join(filter(None, [result.message, kept_note(manifest)]))
                self._clean(attempt)
        except PipelineError as exc:
            return self._error(attempt, exc)
        result.seconds = seconds
        return result


def build_on_cluster(
    project: Project, address: str, names: list[str] | None = None, *, force: bool = False,
    reporter: Reporter | None = None, threads: int = 0,
) -> list[TargetResult]:  # fmt: skip
    """`pipeline build --cluster ADDRESS`: join (or start) the cluster, build, leave (a local
    node's last processes ended with it)."""
    watched = connect(address)
    try:
        return ClusterBuild(project, reporter, threads).run(names, force)
    finally:
        ray.shutdown()
        if watched is not None:
            watched.end()


# --- what runs on the nodes -----------------------------------------------------------------


def node_workspace() -> Path:
    """This host's artifacts root for the builds its nodes run: PIPELINE_NODE_WORKSPACE, else the
    temp dir, then the host's name. Every run and every node of a host reuse it and its caches (the
    F16 base of a GGUF target), under one recipe's locks; a dead task's temporaries are swept as in
    any root. (Keyed by Ray's node id, new at every start, each run left its caches behind.)"""
    base = os.environ.get("PIPELINE_NODE_WORKSPACE") or Path(tempfile.gettempdir()) / "pipeline-node"
    return Path(base) / (re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host")


def _prepare_task(recipe_path: str, root: str) -> str:
    """Source record and reference into the shared root (cached: a second run reuses them)."""
    shared = Project.open(recipe_path, root=Path(root))
    shared.prepare_source()
    ctx = shared.context()
    ctx.reference()
    return ctx.reference_key()


def _build_task(
    recipe_path: str, root: str, name: str, previous_inputs: str | None, force: bool, attempt: str,
    threads: int,
) -> dict[str, Any]:  # fmt: skip
    """One target on this node: build, validate and benchmark it in the node's workspace, copy it
    into the shared root's `.incoming/<attempt>`; returns the manifest (never the bytes)."""
    node = ray.get_runtime_context().get_node_id()
    shared = Project.open(recipe_path, root=Path(root))
    incoming = shared.layout.recipe_dir / INCOMING_DIRNAME
    incoming.mkdir(parents=True, exist_ok=True)
    workspace = node_workspace()
    marker = {"node": node, "host": socket.gethostname(), "pid": os.getpid(), "workspace": str(workspace)}
    (incoming / f"{attempt}.running").write_text(json.dumps(marker))
    project = Project.open(recipe_path, root=workspace)
    sweep_leftovers(project.layout)
    spec = project.select([name])[name]
    ctx = project.context(threads=threads, node=node)
    try:
        lock = project.layout.lock_path("reference")
        _seed(shared.layout.reference_dir, project.layout.reference_dir, lock)
        reason = spec.unavailable(ctx, name)
        if reason is not None:
            return {"outcome": STATUS_UNAVAILABLE, "message": reason}
        with build_lock(project.layout, name):
            inputs = project.target_inputs(ctx, name, spec)
            if not force and inputs.sha256 == previous_inputs:
                return {"outcome": "up-to-date"}
            project.check_loadable(ctx, name, spec)  # as a plain build: before any step of it
            # the shared root's files, where only the numbers' inputs moved (a plain build's rule)
            keep = None if force else shared.keepable(name, spec, shared.current_manifest(name), inputs)
            staging = project.layout.new_staging(name)
            try:
                manifest = project.make_artifact(
                    ctx, name, spec, staging, inputs, keep=keep, keep_dir=shared.layout.target_dir(name)
                )
                arrived = incoming / attempt
                _copy_complete(staging, arrived)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        message = f"{name}: no space left on device on node {node[:12]} ({exc.filename})"
        return {"outcome": "error", "message": message, "exit_code": BuildError.exit_code}
    except PipelineError as exc:
        return {"outcome": "error", "message": str(exc), "exit_code": exc.exit_code}
    return {"outcome": "built", "manifest": manifest.model_dump(mode="json"), "dir": str(arrived)}


def _copy_complete(src: Path, dst: Path) -> None:
    """Copy a directory to `dst` under a temporary name, renamed into place once complete."""
    tmp = dst.with_name(f"{dst.name}.tmp")
    remove_path(tmp)
    try:
        shutil.copytree(src, tmp)
        tmp.rename(dst)
    except BaseException:
        remove_path(tmp)
        raise


def _seed(shared_dir: Path, local_dir: Path, lock: Path) -> None:
    """Copy a cached step's directory (the reference) from the shared root into this node's
    workspace as the same cached step (its key), unless the workspace already holds that one."""
    key = read_key(shared_dir)
    if key is not None:
        cached_step(local_dir, key, lambda tmp: shutil.copytree(shared_dir, tmp, dirs_exist_ok=True), lock)


def _first_line(exc: BaseException) -> str:
    """A Ray error's one line: the task's own exception where there is one."""
    cause = getattr(exc, "cause", None)
    text = str(cause) if cause is not None else str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:400] if lines else type(exc).__name__


def _error_of(out: dict[str, Any]) -> PipelineError:
    """The task's PipelineError again, with its exit code."""
    error = PipelineError(out["message"])
    error.exit_code = out["exit_code"]
    return error
