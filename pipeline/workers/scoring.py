"""The scorers every engine worker uses: one for evaluation windows, one for smoke generations.

Stdlib at import (numpy inside the functions): imported in every tool environment. What each
number means is fixed here, so llama.cpp, vLLM, SGLang and TensorRT-LLM report the same measures:

- `ppl`: perplexity of the engine on the reference's evaluation token ids.
- `kld_mean`: mean full-vocabulary KL(reference || engine) per predicted token (engines that
  return whole logit rows: llama.cpp, TensorRT-LLM).
- `kld_topk_mean`: the same KL on the partition {each of the engine's top-k tokens} + {the rest},
  a lower bound of `kld_mean` (engines that return only top-k logprobs: vLLM, SGLang).
- `top1_agreement`: share of positions where the engine's and the reference's argmax agree.
- `token_agreement`: leading-token agreement of greedy generations on the smoke prompts.
- `tokens_per_s`: smoke prompts generated one at a time, generated tokens / wall seconds
  (prefill included); `prompt_tokens_per_s`: evaluation tokens processed / wall seconds.

Which positions count is llama-perplexity's convention, the field's scoreboard: the evaluation ids
are cut into windows of `ctx` tokens, each window starts with BOS when the model's tokenizer adds
one (the reference writes it into the ids), and only the predictions made with at least `ctx/2`
tokens of context are scored (`scored_from`, recorded in the reference and the manifest).
"""

from __future__ import annotations

import math
from typing import Any

# Part of the reference's inputs (so of every target's): bump when which ids or positions are scored
# changes. 2: llama-perplexity's framing (BOS-headed windows where the tokenizer adds BOS, positions
# from ctx/2 on); 1 (unrecorded): no BOS, every position from the second on.
EVAL_CONVENTION = {"version": 2, "framing": "llama-perplexity", "scored_from": "ctx/2"}
KLD_FULL = "kld_mean"
KLD_TOPK = "kld_topk_mean"


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _log_softmax(x: Any) -> Any:
    """Row-wise log-softmax of a 2-D array (float64)."""
    import numpy as np

    x = np.asarray(x, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def scored_from(ctx: int) -> int:
    """The first position of a window whose prediction is scored: llama-perplexity's `n_ctx/2`."""
    return ctx // 2


class WindowScorer:
    """Accumulates an engine's scores on the evaluation windows against the reference's logits
    (`ref_logits`: one row per position of the reference's evaluation ids, full vocabulary);
    `reference` is the reference's record, whose `ctx` and `scored_from` say which positions count."""

    def __init__(self, ref_logits: Any, reference: dict[str, Any]) -> None:
        self.ref_logits = ref_logits
        self.ctx = int(reference["ctx"])
        self.first = int(reference["scored_from"])
        self.nll = self.kld = 0.0
        self.top1 = self.predicted = 0
        self.measure: str | None = None
        self.top_k: int | None = None

    def _use(self, measure: str) -> None:
        if self.measure not in (None, measure):
            raise ValueError(f"one scorer cannot mix {self.measure} and {measure}")
        self.measure = measure

    def scored(self, position: int) -> bool:
        """Whether the prediction made at `position` of the evaluation ids counts."""
        return position % self.ctx >= self.first

    def add_logits(self, start: int, logits: Any, next_ids: list[int]) -> None:
        """Full logit rows for positions start.. of the evaluation ids; row i predicts next_ids[i]
        (rows of unscored positions are dropped here)."""
        import numpy as np

        self._use(KLD_FULL)
        keep = [i for i in range(len(next_ids)) if self.scored(start + i)]
        if not keep:
            return
        rows = len(keep)
        vocab = min(logits.shape[1], self.ref_logits.shape[1])
        logq = _log_softmax(np.asarray(logits[: len(next_ids), :vocab])[keep])
        logp = _log_softmax(np.asarray(self.ref_logits[start : start + len(next_ids), :vocab])[keep])
        targets = np.array(next_ids)[keep]
        self.nll -= float(logq[np.arange(rows), targets].sum())
        self.kld += float((np.exp(logp) * (logp - logq)).sum())
        self.top1 += int((logq.argmax(1) == logp.argmax(1)).sum())
        self.predicted += rows

    def add_topk(self, position: int, next_logprob: float, top: dict[int, float], k: int) -> None:
        """One position's engine logprobs: the actual next token's and its top-k (token id -> logprob);
        an unscored position is ignored."""
        import numpy as np

        self._use(KLD_TOPK)
        if not self.scored(position):
            return
        self.top_k = k
        p = np.exp(_log_softmax(np.asarray(self.ref_logits[position])))
        q = {t: math.exp(lp) for t, lp in top.items()}
        p_sel = {t: float(p[t]) for t in top}
        kld = sum(p_sel[t] * (math.log(p_sel[t]) - math.log(q[t])) for t in top if p_sel[t] > 0)
        p_rest, q_rest = max(1.0 - sum(p_sel.values()), 0.0), max(1.0 - sum(q.values()), 1e-12)
        if p_rest > 0:
            kld += p_rest * (math.log(p_rest) - math.log(q_rest))
        self.nll -= next_logprob
        self.kld += kld
        self.top1 += int(max(top, key=top.__getitem__) == int(p.argmax()))
        self.predicted += 1

    def result(self) -> dict[str, Any]:
        if not self.predicted or self.measure is None:
            raise ValueError("no evaluation position was scored")
        out: dict[str, Any] = {
            "ppl": float(math.exp(self.nll / self.predicted)),
            self.measure: self.kld / self.predicted,
            "top1_agreement": self.top1 / self.predicted,
            "predicted_tokens": self.predicted,
        }
        if self.top_k is not None:
            out["kld_top_k"] = self.top_k
        return out


def windows(eval_ids: list[int], ctx: int) -> list[tuple[int, list[int]]]:
    """The evaluation windows: (start position, ids) of each whole window of ctx tokens."""
    return [(c * ctx, eval_ids[c * ctx : (c + 1) * ctx]) for c in range(len(eval_ids) // ctx)]


def agreement(ours: list[int], want: list[int]) -> float:
    """Leading-token agreement of a greedy answer with the reference's: the shared prefix over the
    reference's length; an empty reference answer agrees only with an empty answer."""
    if not want:
        return float(not ours)
    return common_prefix(ours, want) / len(want)


def generation_record(reference: dict[str, Any], ids: list[int], text: str, stopped_at_eos: bool) -> dict:
    """One smoke prompt's greedy answer from an engine, scored against the reference's."""
    return {
        "prompt": reference["prompt"],
        "text": text,
        "reference_text": reference["text"],
        "output_ids": ids,
        "tokens": len(ids),
        "stopped_at_eos": stopped_at_eos,
        "leading_tokens_agreed": common_prefix(ids, reference["output_ids"]),
        "agreement": agreement(ids, reference["output_ids"]),
    }


def generation_scores(records: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """token_agreement and tokens_per_s over the smoke prompts (generated one at a time)."""
    tokens = sum(r["tokens"] for r in records)
    return {
        "token_agreement": sum(r["agreement"] for r in records) / len(records),
        "tokens_per_s": tokens / seconds if seconds > 0 and tokens else None,
        "generations": records,
    }
