"""Every shipped config loads and validates (configs/smol-dense.yaml carried a removed key,
``task.eval_size``, unnoticed until the real loop was launched from it)."""
from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.config import load_config

REPO = Path(__file__).resolve().parents[1]

CONFIGS = sorted(p.name for p in (Path(REPO) / "configs").glob("*.yaml"))


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_config_loads(name):
    cfg = load_config(str(Path(REPO) / "configs" / name), [])
    assert cfg.learner.max_tokens_per_microbatch >= 1


def test_smol_dense_is_the_issue_shape():
    """The CPU real-loop recipe of issue 15: 8 x 8 samples, <= 24 tokens, hf_fast, shared prompts,
    and one log-prob chunk per micro-batch (its logits kept for the backward)."""
    cfg = load_config(str(Path(REPO) / "configs" / "smol-dense.yaml"), [])
    r, lc = cfg.rollout, cfg.learner
    assert (r.prompts_per_batch, r.group_size, r.max_new_tokens, lc.groups_per_step) == (8, 8, 24, 8)
    assert r.engine == "hf_fast" and lc.shared_prompt
    assert lc.logprob_chunk_tokens >= 2 * r.group_size * r.max_new_tokens
