"""Turning an engine worker's scores into a verdict: the manifest's metrics, the gates, the engine's
version. Every engine's validation goes through here, so a verdict means the same everywhere."""

from __future__ import annotations

import math
from typing import Any

from pipeline.constants import ENGINES, KLD_GATES
from pipeline.context import BuildContext
from pipeline.manifest import EngineVerdict, Metrics, Status
from pipeline.spec import Gates

# Numbers every worker reports (pipeline.workers.scoring); the rest of a worker's result goes to
# the verdict's details or is dropped.
_SCORES = ("ppl", "kld_mean", "kld_topk_mean", "kld_top_k", "top1_agreement", "token_agreement")
_SPEEDS = ("tokens_per_s", "prompt_tokens_per_s")


def metrics(scores: dict[str, Any], reference: dict[str, Any], **extra: Any) -> Metrics:
    """The manifest's metrics from a worker's scores and the transformers reference."""
    return Metrics(
        **{k: scores.get(k) for k in (*_SCORES, *_SPEEDS)},
        ppl_ref=reference["ppl"],
        ppl_delta_pct=(scores["ppl"] / reference["ppl"] - 1.0) * 100.0,
        eval_tokens=len(reference["eval_ids"]),
        scored_tokens=scores.get("predicted_tokens"),
        **extra,
    )


def gate(engine: str, m: Metrics, gates: Gates) -> tuple[Status, str | None]:
    """(status, reason): ΔPPL and the KL divergence this engine measures always gate; token
    agreement gates only when the recipe sets it."""
    failures = []
    broken = [k for k in ("ppl", "ppl_delta_pct", "token_agreement") if not math.isfinite(getattr(m, k))]
    if broken:  # NaN compares false with every limit: it must fail, not pass
        failures.append(f"{', '.join(broken)} not finite")
    if m.ppl_delta_pct > gates.max_ppl_delta_pct:
        failures.append(f"ΔPPL {m.ppl_delta_pct:.3f}% > {gates.max_ppl_delta_pct}%")
    kld_metric = ENGINES[engine].kld_metric
    limit, value = getattr(gates, KLD_GATES[kld_metric]), getattr(m, kld_metric)
    if value is None or not math.isfinite(value):
        failures.append(f"{engine} reported no finite {kld_metric}")
    elif limit is not None and value > limit:
        failures.append(f"{kld_metric} {value:.5f} > {limit}")
    if m.token_agreement < gates.min_token_agreement:
        failures.append(f"token agreement {m.token_agreement:.2f} < {gates.min_token_agreement}")
    return ("failed", "; ".join(failures)) if failures else ("passed", None)


def engine_version(ctx: BuildContext, engine: str) -> str | None:
    """The version of the serving engine as its environment reports it."""
    versions = ctx.versions(ENGINES[engine].env)
    return next((versions[d] for d in ENGINES[engine].version_dists if versions.get(d)), None)


def verdict(
    ctx: BuildContext,
    engine: str,
    scores: dict[str, Any],
    reference: dict[str, Any],
    gates: Gates,
    extra_metrics: dict[str, Any] | None = None,
    **details: Any,
) -> EngineVerdict:
    """One engine's gated verdict on an artifact from its worker's scores."""
    m = metrics(scores, reference, **(extra_metrics or {}))
    status, reason = gate(engine, m, gates)
    return EngineVerdict(
        status=status,
        reason=reason,
        engine_version=engine_version(ctx, engine),
        metrics=m,
        gates=gates.model_dump(),
        generations=scores.get("generations", []),
        details=details,
    )


def not_run(status: Status, reason: str, **details: Any) -> EngineVerdict:
    """A verdict for an engine that did not score the artifact (skipped: never counts as passed)."""
    return EngineVerdict(status=status, reason=reason, details=details)


def reference_record(reference: dict[str, Any]) -> dict[str, Any]:
    """What the manifest says about the reference the numbers are relative to: the precision and
    device it ran in (chosen from the model size and free memory: pipeline.workers.reference) and
    the scoring convention."""
    place = reference.get("placement") or {"dtype": "float32", "device": "cpu"}  # made before placement
    return {
        "engine": "transformers",
        "toolchain": reference["toolchain"],
        "dtype": place["dtype"],
        "device": place.get("device_name", place["device"]),
        # which ids and positions every number is on (pipeline.workers.scoring): windows of ctx
        # tokens headed by BOS when the tokenizer adds one, predictions from position scored_from on
        "ctx": reference["ctx"],
        "bos_token_id": reference.get("bos_token_id"),
        "scored_from": reference.get("scored_from", 0),  # 0: a reference made before conventions
    }
