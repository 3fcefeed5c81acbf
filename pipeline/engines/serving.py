"""The serve check on the core side, shared by the engines that serve over HTTP (vLLM, SGLang):
the engine's worker runs the manifest's serve command once (pipeline.workers.serving), and a served
answer that leaves the offline greedy answer fails that engine's verdict."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.manifest import EngineVerdict

if TYPE_CHECKING:  # the target kinds import this module
    from pipeline.targets.base import BuildContext

SERVE_TIMEOUT_S = 900


def serve_check(
    ctx: BuildContext,
    env: str,
    name: str,
    artifact: Path,
    command: str,
    scores: dict[str, Any],
    result: EngineVerdict,
) -> None:
    """Run `command` for `artifact` in env's worker and record it in `result.details["serve_check"]`;
    `scores` is the same engine's offline result (its greedy answer and top logprobs)."""
    ref, _ = ctx.reference()
    expected = scores["generations"][0]
    served = ctx.step(
        env,
        {
            "op": "serve_check",
            "model_dir": str(artifact),
            "command": command,
            "prompt_ids": ref["generations"][0]["prompt_ids"],
            "max_tokens": ctx.loaded.recipe.smoke.max_new_tokens,
            "expected_text": expected["text"],
            "expected_ids": expected["output_ids"],
            "expected_top": scores.get("first_generation_top_logprobs") or [],
            "server_log": str(ctx.log_path(f"{name}-{env}-server")),
            "ready_timeout_s": SERVE_TIMEOUT_S - 240,  # + the request and shutdown < the step limit
        },
        name,
        timeout_s=SERVE_TIMEOUT_S,
    )
    result.details["serve_check"] = served
    if served["ok"]:
        return
    at = served.get("divergence") or {}
    gap = at.get("gap_nats")
    rated = f"{gap:.3f} nats below the offline choice" if gap is not None else "not a near-tie"
    where = f" from token {at['position']} ({rated})" if at else ""
    result.status = "failed"
    result.reason = (
        f"the served answer differs from the offline greedy answer ({served['compared']}){where}: "
        f"{served['text']!r} {served['token_ids']} vs {expected['text']!r} {expected['output_ids']}"
    )
