"""The roller factory and the hf_fast engine configuration: one roller per config through the
Roller protocol (single-turn or episodes), and FastHFConfig built and validated once."""
from __future__ import annotations

import itertools

import pytest

from streamrl.config import load_config
from streamrl.engines.factory import build_engine, fast_hf_config
from streamrl.engines.hf_fast_config import FastHFConfig
from streamrl.envs.roller import EpisodeBatchRoller
from streamrl.models.factory import build_model
from streamrl.rollout.batch import BatchRoller
from streamrl.rollout.factory import build_roller
from streamrl.tasks import build_task
from streamrl.tasks.registry import problem_stream
from streamrl.trajectory import make_id, validate_trajectories


def _roll(repo, config: str, overrides: list[str]):
    cfg = load_config(repo / config, ["rollout.group_size=2", "rollout.prompts_per_batch=2", *overrides])
    model, tok = build_model(cfg.model, seed=0)
    engine = build_engine(cfg, model, tok)
    ids = itertools.count(1)
    roller = build_roller(cfg, engine, tok, problem_stream(build_task(cfg.task), 0, 0, 1), worker_id=1,
                          next_id=lambda: make_id(1, next(ids)))
    try:
        td = roller.rollout_batch(version=4)
        metrics = dict(roller.last_metrics)
    finally:
        roller.close()
        engine.close()
    return roller, td, metrics


def test_single_turn_config_builds_the_batch_roller(repo):
    roller, td, metrics = _roll(repo, "configs/tiny.yaml", [])
    assert isinstance(roller, BatchRoller)
    validate_trajectories(td)
    assert td["reward"].numel() == 4 and set(td["policy_version"].tolist()) == {4}
    assert set(metrics) == {"rollout/truncated", "rollout/reward_errors"} and metrics["rollout/reward_errors"] == 0


def test_env_config_builds_the_episode_roller(repo, monkeypatch):
    monkeypatch.chdir(repo)
    roller, td, metrics = _roll(repo, "configs/tiny-tools.yaml", [])
    assert isinstance(roller, EpisodeBatchRoller)
    validate_trajectories(td)
    assert td["reward"].numel() == 4 and set(td["policy_version"].tolist()) == {4}
    assert metrics["env/turns_mean"] >= 1


def test_fast_hf_config_from_the_run_config():
    cfg = load_config(None, ["rollout.engine=hf_fast", "rollout.kv_cache=paged", "rollout.kv_block_size=8",
                             "rollout.kv_pool_mb=1", "rollout.max_model_len=96", "rollout.max_new_tokens=32"])
    model, _ = build_model(cfg.model, seed=0)
    fc = fast_hf_config(cfg, model)
    rc = cfg.rollout
    assert (fc.batch_size, fc.max_seq_len, fc.kv_cache, fc.block_size) == (
        rc.prompts_per_batch * rc.group_size, 96, "paged", 8)
    assert fc.kv_blocks is not None and fc.kv_blocks > 0


@pytest.mark.parametrize("fields,name", [
    ({"batch_size": 0}, "batch_size"), ({"top_p": 0.0}, "top_p"), ({"sync_every": 0}, "sync_every"),
    ({"kv_cache": "ring"}, "kv_cache"), ({"kv_cache": "paged", "span_bucket": 20}, "span_bucket"),
    ({"paged_attention": "flex"}, "paged_attention"), ({"decode_attention": "flash"}, "decode_attention"),
    ({"device": "cuda", "kv_cache": "paged", "paged_attention": "flex"}, "paged_attention")])
def test_fast_hf_config_errors_name_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        FastHFConfig(**fields)
