"""Scoring helpers shared by the engine workers (stdlib + numpy, imported inside the workers)."""

from __future__ import annotations

import math
from typing import Any


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def softmax(x: Any) -> Any:
    import numpy as np

    e = np.exp(x - x.max())
    return e / e.sum()


def kld_topk(p: Any, q_logprobs: dict[int, float]) -> float:
    """KL(P||Q) on the partition {each token the engine returned} + {everything else}.

    P is the reference's full next-token distribution; engines that return only their top-K
    logprobs give Q on those tokens. Coarsening never increases KL, so this is a lower bound of
    the full-vocabulary KL, and equal to it when the rest carries no mass.
    """
    ids = list(q_logprobs)
    q = [math.exp(q_logprobs[t]) for t in ids]
    p_sel = [float(p[t]) for t in ids]
    total = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p_sel, q, strict=True) if pi > 0)
    p_rest, q_rest = max(1.0 - sum(p_sel), 0.0), max(1.0 - sum(q), 1e-12)
    if p_rest > 0:
        total += p_rest * (math.log(p_rest) - math.log(q_rest))
    return total


def log_softmax(x: Any) -> Any:
    """Row-wise log-softmax of a 2-D logits array."""
    import numpy as np

    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def window_scores(ours: Any, theirs: Any, next_ids: list[int]) -> tuple[float, float, int]:
    """One evaluation window, an engine's logits against the reference's (rows: positions, full
    vocabulary): summed NLL of the next tokens, summed KL(reference || engine), top-1 matches."""
    import numpy as np

    logq, logp = log_softmax(ours), log_softmax(theirs)
    nll = float(-logq[np.arange(len(next_ids)), np.array(next_ids)].sum())
    kld = float((np.exp(logp) * (logp - logq)).sum())
    return nll, kld, int((ours.argmax(1) == theirs.argmax(1)).sum())
