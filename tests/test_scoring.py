"""The one window scorer and the one generation scorer every engine worker uses."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.workers.scoring import KLD_FULL, KLD_TOPK, WindowScorer, agreement, generation_scores


def _logits(rows: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2, (rows, vocab))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_full_and_topk_kl_agree_when_k_is_the_whole_vocabulary_and_topk_is_a_lower_bound() -> None:
    ref, ours = _logits(6, 40, 0), _logits(6, 40, 1)
    next_ids = [3, 7, 1, 0, 39, 12]
    full = WindowScorer(ref)
    full.add_logits(0, ours, next_ids)
    whole, top5 = WindowScorer(ref), WindowScorer(ref)
    logq = _log_softmax(ours)
    for i, nid in enumerate(next_ids):
        row = {t: float(logq[i, t]) for t in range(40)}
        whole.add_topk(i, row[nid], row, 40)
        best = {t: row[t] for t in sorted(row, key=row.__getitem__)[-5:]}
        top5.add_topk(i, row[nid], best, 5)
    f, w, t = full.result(), whole.result(), top5.result()
    assert w[KLD_TOPK] == pytest.approx(f[KLD_FULL], rel=1e-9)
    assert 0 < t[KLD_TOPK] <= f[KLD_FULL] + 1e-12
    assert f["ppl"] == pytest.approx(w["ppl"]) == pytest.approx(t["ppl"])
    assert f["top1_agreement"] == w["top1_agreement"] == t["top1_agreement"]
    assert KLD_TOPK not in f and KLD_FULL not in t and t["kld_top_k"] == 5


def test_identical_logits_score_zero_kl_and_the_reference_perplexity() -> None:
    ref = _logits(4, 10, 2)
    scorer = WindowScorer(ref)
    scorer.add_logits(0, ref.copy(), [1, 2, 3, 4])
    r = scorer.result()
    nll = -sum(_log_softmax(ref)[i, t] for i, t in enumerate([1, 2, 3, 4]))
    assert r[KLD_FULL] == pytest.approx(0, abs=1e-12) and r["top1_agreement"] == 1.0
    assert r["ppl"] == pytest.approx(math.exp(nll / 4))


def test_one_scorer_never_mixes_measures_or_reports_nothing() -> None:
    scorer = WindowScorer(_logits(2, 8, 3))
    with pytest.raises(ValueError, match="no evaluation position"):
        scorer.result()
    scorer.add_logits(0, _logits(1, 8, 4), [1])
    with pytest.raises(ValueError, match="cannot mix kld_mean and kld_topk_mean"):
        scorer.add_topk(1, -1.0, {1: -1.0}, 1)


def test_agreement_is_one_rule_for_every_engine() -> None:
    assert agreement([1, 2, 3], [1, 2, 9, 9]) == 0.5
    assert agreement([], []) == 1.0  # nothing to say, said nothing
    assert agreement([5], []) == 0.0  # the reference stopped at once; this one did not
    assert agreement([], [1]) == 0.0
    records = [{"tokens": 4, "agreement": 1.0}, {"tokens": 2, "agreement": 0.0}]
    scores = generation_scores(records, 2.0)
    assert scores["token_agreement"] == 0.5 and scores["tokens_per_s"] == 3.0
