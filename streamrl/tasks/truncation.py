"""The truncation rule: a response cut at the token limit scores 0, and is counted.

A task opts in with ``truncated_scores_zero = True`` (reasoning-gym's ``think`` format: a chain
of thought cut at ``max_new_tokens`` never reached its final answer line, and paying an answer
found inside it would reward rambling up to the limit). Whatever the task, callers count the
truncated responses (``rollout/truncated``, ``eval/truncated``): a share near 1 means the limit,
not the policy, decides the reward.

A response is *truncated* when it holds ``limit`` tokens and no end-of-sequence token: generation
stopped because the budget ran out, not because the model finished.

Hook-up where rewards are computed (one call after scoring)::

    rewards, truncated = apply_truncation_rule(rewards, gen.tokens, stop_ids(tok), limit, zeroes_truncated(task))
"""
from __future__ import annotations

from typing import Iterable, Sequence


def stop_ids(tok, model=None) -> frozenset[int]:
    """End-of-sequence ids of a tokenizer (and of ``model.generation_config``, which may list more)."""
    ids = set()
    sources = [getattr(tok, "eos_token_id", None)]
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None:
        sources.append(getattr(gen_cfg, "eos_token_id", None))
    for src in sources:
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, Iterable):
            ids.update(int(i) for i in src)
    return frozenset(ids)


def is_truncated(ids: Sequence[int], eos: frozenset[int], limit: int) -> bool:
    """True when ``ids`` (one response's tokens) ran to ``limit`` without any id in ``eos``."""
    return len(ids) >= limit and not any(int(t) in eos for t in ids)


def zeroes_truncated(task) -> bool:
    """Whether ``task`` scores a truncated response 0 (its ``truncated_scores_zero``; default no)."""
    return bool(getattr(task, "truncated_scores_zero", False))


def apply_truncation_rule(rewards: Sequence[float], token_lists: Sequence[Sequence[int]], eos: frozenset[int],
                          limit: int, zero: bool) -> tuple[list[float], list[bool]]:
    """``(rewards, truncated)``: the rewards, truncated responses set to 0 when ``zero``, and the
    per-response truncation flags ([B] each)."""
    if len(rewards) != len(token_lists):
        raise ValueError(f"{len(rewards)} rewards for {len(token_lists)} responses")
    flags = [is_truncated(ids, eos, limit) for ids in token_lists]
    return [0.0 if (zero and cut) else float(r) for r, cut in zip(rewards, flags)], flags
