"""Engine vs learner log-prob parity on a fixed, teacher-forced probe set.

After every weight update a worker can score the same probe sequences (prompt + reference
answer) in its engine and in a transformers copy of the learner's model holding the same
weights. Token log-probs should agree to float precision; a gap means the engine computes
a different policy than the learner trains (kernel numerics, a stale cache, a bad weight
conversion), which biases the importance weights. An engine in a lower ``rollout.dtype`` than
the learner's ``model.dtype`` differs by its rounding too: that gap is expected, and it is what
the learner's importance weights correct (the reference stays in ``model.dtype``).

``rollout/mismatch_kl`` is the mean over probe tokens of the k3 estimator
``exp(d) - 1 - d`` with ``d = log p_learner - log p_engine`` (>= 0, 0 iff equal; it is the
standard low-variance estimate of KL(engine || learner) when tokens come from the engine).
"""
from __future__ import annotations

import math

from streamrl.tasks.registry import eval_problems


def probe_set(task, encode, count: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """``count`` fixed sequences (prompt + answer tokens) and where each answer starts."""
    seqs, starts = [], []
    for p in eval_problems(task, seed + 104729, count):  # disjoint from the held-out eval seeds
        prompt = encode(p.prompt)
        answer = encode_answer(encode, p.answer)
        seqs.append(prompt + answer)
        starts.append(len(prompt))
    return seqs, starts


def encode_answer(encode, answer: str) -> list[int]:
    """Answer tokens without special tokens (``encode`` is the worker's prompt encoder)."""
    return encode(answer, raw=True)


def mismatch_metrics(engine_lp: list[list[float]], ref_lp: list[list[float]]) -> dict[str, float]:
    """``rollout/mismatch_kl`` (mean k3), ``rollout/mismatch_logprob_abs_mean`` and ``_abs_max``."""
    k3, absd, n, mx = 0.0, 0.0, 0, 0.0
    for a, b in zip(engine_lp, ref_lp, strict=True):
        for e, r in zip(a, b, strict=True):
            d = r - e
            k3 += math.exp(d) - 1.0 - d
            absd += abs(d)
            mx = max(mx, abs(d))
            n += 1
    n = max(n, 1)
    return {"rollout/mismatch_kl": k3 / n, "rollout/mismatch_logprob_abs_mean": absd / n,
            "rollout/mismatch_logprob_abs_max": mx}
