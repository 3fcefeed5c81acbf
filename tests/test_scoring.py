"""The one window scorer and the one generation scorer every engine worker uses."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.workers.calibration import bos_id, bos_windows, calibration_chunks, document_ids
from pipeline.workers.scoring import (
    KLD_FULL,
    KLD_TOPK,
    WindowScorer,
    agreement,
    generation_scores,
    scored_from,
)

EVERY = {"ctx": 1_000, "scored_from": 0}  # one long window, every position scored


def _logits(rows: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2, (rows, vocab))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_full_and_topk_kl_agree_when_k_is_the_whole_vocabulary_and_topk_is_a_lower_bound() -> None:
    ref, ours = _logits(6, 40, 0), _logits(6, 40, 1)
    next_ids = [3, 7, 1, 0, 39, 12]
    full = WindowScorer(ref, EVERY)
    full.add_logits(0, ours, next_ids)
    whole, top5 = WindowScorer(ref, EVERY), WindowScorer(ref, EVERY)
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
    scorer = WindowScorer(ref, EVERY)
    scorer.add_logits(0, ref.copy(), [1, 2, 3, 4])
    r = scorer.result()
    nll = -sum(_log_softmax(ref)[i, t] for i, t in enumerate([1, 2, 3, 4]))
    assert r[KLD_FULL] == pytest.approx(0, abs=1e-12) and r["top1_agreement"] == 1.0
    assert r["ppl"] == pytest.approx(math.exp(nll / 4))


def test_one_scorer_never_mixes_measures_or_reports_nothing() -> None:
    scorer = WindowScorer(_logits(2, 8, 3), EVERY)
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


def test_only_positions_from_half_a_window_on_are_scored_as_llama_perplexity_does() -> None:
    """Two windows of 8: the predictions at positions 4..6 of each count (llama-perplexity scores
    logits j in [n_ctx/2, n_ctx-1)), in both the full-row and the top-k paths."""
    ctx = 8
    assert scored_from(ctx) == 4 and scored_from(512) == 256
    ref, ours = _logits(2 * ctx, 30, 5), _logits(2 * ctx, 30, 6)
    ids = list(np.random.default_rng(7).integers(0, 30, 2 * ctx))
    record = {"ctx": ctx, "scored_from": scored_from(ctx)}
    full, top = WindowScorer(ref, record), WindowScorer(ref, record)
    logq = _log_softmax(ours)
    for start in (0, ctx):
        window = ids[start : start + ctx]
        full.add_logits(start, ours[start : start + ctx - 1], window[1:])
        for i in range(1, ctx):
            row = {t: float(logq[start + i - 1, t]) for t in range(30)}
            top.add_topk(start + i - 1, row[window[i]], row, 30)
    counted = [p for start in (0, ctx) for p in range(start + 4, start + ctx - 1)]
    nll = -sum(logq[p, ids[p + 1]] for p in counted)
    f, t = full.result(), top.result()
    assert f["predicted_tokens"] == t["predicted_tokens"] == len(counted) == 6
    assert f["ppl"] == pytest.approx(math.exp(nll / 6)) == pytest.approx(t["ppl"])
    assert t[KLD_TOPK] == pytest.approx(f[KLD_FULL], rel=1e-9)
    # the unscored positions do move the number when they are counted (every position of a window)
    every = WindowScorer(ref, {"ctx": ctx, "scored_from": 0})
    every.add_logits(0, ours[: ctx - 1], ids[1:ctx])
    assert every.result()["predicted_tokens"] == 7


class _Tokenizer:
    """A tokenizer's two behaviours that matter here: ids of a text, and whether it adds BOS."""

    def __init__(self, bos: int | None, adds: bool) -> None:
        self.bos_token_id, self.adds = bos, adds

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [100 + ord(c) for c in text]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens and self.adds else []) + ids}


def test_documents_and_windows_start_with_bos_exactly_when_the_tokenizer_adds_one() -> None:
    """The rule llama.cpp's tools follow (`add_bos_token`): a Gemma/Llama-style tokenizer adds BOS,
    SmolLM2's and Qwen2's declare one and do not add it."""
    adds, declares, none = _Tokenizer(2, True), _Tokenizer(2, False), _Tokenizer(None, False)
    assert (bos_id(adds), bos_id(declares), bos_id(none)) == (2, None, None)
    ids, bos = document_ids(adds, "abcdefg")
    assert bos == 2 and ids == [2, 197, 198, 199, 200, 201, 202, 203]
    assert bos_windows(ids, 3, bos) == [[2, 197, 198], [2, 200, 201]]  # each head replaced, tail dropped
    plain, none_bos = document_ids(declares, "abcdefg")
    assert none_bos is None and plain == [197, 198, 199, 200, 201, 202, 203]
    assert bos_windows(plain, 3, None) == [[197, 198, 199], [200, 201, 202]]
    # calibration chunks: the same framing, then the seeded selection
    assert calibration_chunks(ids, 5, 3, 0, bos) == [[2, 197, 198], [2, 200, 201]]
    assert calibration_chunks(plain, 1, 3, 0) in ([[197, 198, 199]], [[200, 201, 202]])
