"""The rollout worker plays multi-turn tool episodes: the ``env`` config section, the
worker wiring (real Redis, a real weights publisher, the worker's own roller and engine), the
learner's loss mask on the worker's trajectories, bounded tools, and version changes between
turns. Plug-in environments: tests/env_plugins.py.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

import env_plugins
from streamrl.config import ConfigError, load_config
from streamrl.coord.coordinator import Coordinator
from streamrl.models.factory import build_model
from streamrl.preflight import preflight
from streamrl.trajectory import to_padded, validate_trajectories

TINY_TOOLS = "configs/tiny-tools.yaml"


# ---- config and preflight -----------------------------------------------------------------

@pytest.mark.parametrize("override,field", [
    ("env.name=calculater", "env.name"), ("env.max_turns=0", "env.max_turns"),
    ("env.max_total_tokens=1", "env.max_total_tokens"), ("env.max_tool_calls=0", "env.max_tool_calls"),
    ("env.tool_timeout_s=0", "env.tool_timeout_s"), ("env.call_reward=-1", "env.call_reward"),
    ("env.lanes=0", "env.lanes"), ("env.max_turn=3", "env.max_turns")])
def test_env_config_errors_name_the_field(repo, override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(repo / TINY_TOOLS, [override])


def test_env_config_defaults_to_single_turn(repo):
    assert load_config(repo / "configs/tiny.yaml").env.name == "none"
    assert load_config(repo / TINY_TOOLS).env.name == "calculator"


@pytest.mark.parametrize("name,problem", [
    ("env_plugins:nope", "has no attribute 'nope'"), ("no_such_module_xyz:make", "cannot import"),
    ("env_plugins:NOT_A_FUNCTION", "not callable")])
def test_preflight_names_a_broken_env_plugin(repo, name, problem):
    problems = preflight(load_config(repo / TINY_TOOLS, [f"env.name={name}"]))
    assert len(problems) == 1 and "env.name" in problems[0] and problem in problems[0]
    assert preflight(load_config(repo / TINY_TOOLS, ["env.name=env_plugins:flaky_tools"])) == []


# ---- the worker ---------------------------------------------------------------------------

class _Run:
    """A rollout worker of a real run (Redis, config, published v0), without the send loop."""

    def __init__(self, redis_url, run_id, overrides):
        from streamrl.weights.factory import make_publisher
        from streamrl.workers.rollout import RolloutWorker

        self.cfg = load_config(TINY_TOOLS, overrides)
        self.coord = Coordinator(redis_url, run_id)
        self.coord.put_config(self.cfg.to_dict())
        self.model, _ = build_model(self.cfg.model, seed=self.cfg.run.seed)
        self.specs = [(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]
        self.publisher = make_publisher(self.coord, run_id, self.cfg)
        self.worker = RolloutWorker(argparse.Namespace(redis_url=redis_url, run_id=run_id, worker_id=0,
                                                       num_workers=1, device=None))
        self.publish(0)
        self.worker.sync_weights()

    def publish(self, version: int) -> None:
        self.publisher.publish(version, self.specs, (p.detach() for _, p in self.model.named_parameters()))

    def close(self):
        self.worker.roller.close()
        self.worker.engine.close()
        self.worker.metrics.close()
        self.publisher.close()


@pytest.fixture
def tiny_run(redis_url, run_id, repo, monkeypatch):
    monkeypatch.chdir(repo)
    env_plugins.RELEASE.clear()
    runs = []

    def start(*overrides):
        runs.append(_Run(redis_url, run_id, list(overrides)))
        return runs[-1]
    yield start
    env_plugins.RELEASE.set()
    for r in runs:
        r.close()


def _reply_spans(mask: list[bool]) -> list[tuple[int, int]]:
    spans, start = [], None
    for j, m in enumerate(mask + [True]):
        if not m and start is None:
            start = j
        elif m and start is not None:
            spans.append((start, j))
            start = None
    return spans


@pytest.mark.timeout(120)
def test_worker_episodes_train_model_tokens_only_and_match_teacher_forcing(tiny_run):
    """The worker's roller plays real calculator episodes; the tool reply is the only masked span
    of every trajectory, the learner's loss mask drops it, and the model turns' behaviour
    log-probs equal teacher forcing over the whole conversation."""
    from streamrl.envs.roller import EpisodeBatchRoller

    run = tiny_run("env.name=env_plugins:calculator_then_answer", "rollout.group_size=2",
                   "rollout.prompts_per_batch=2")
    w = run.worker
    assert isinstance(w.roller, EpisodeBatchRoller)
    torch.manual_seed(0)
    td = w.roller.rollout_batch(0)
    validate_trajectories(td, max_version=0)
    tok = w.tok
    padded = to_padded(td, pad_id=tok.pad_token_id)
    starts = td["prompt_lens"].tolist()
    seqs, masks = [], []
    offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), td["response_lens"]]), 0).tolist()
    prompt_off = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), td["prompt_lens"]]), 0).tolist()
    for i in range(len(starts)):
        prompt = td["prompt_tokens"][prompt_off[i]:prompt_off[i + 1]].tolist()
        resp = td["response_tokens"][offsets[i]:offsets[i + 1]].tolist()
        mask = td["response_mask"][offsets[i]:offsets[i + 1]].tolist()
        answer = str(eval(tok.decode(prompt).rstrip("=")))  # noqa: S307 (digits and * only)
        (a, b), = _reply_spans(mask)  # exactly one tool reply, after the first model turn
        assert tok.decode(resp[a:b]) == f"={answer} " and a > 0 and b < len(resp)
        assert td["behaviour_logprobs"][offsets[i] + a:offsets[i] + b].abs().sum() == 0
        p = len(prompt)
        assert padded["loss_mask"][i, p - 1:p - 1 + len(resp)].bool().tolist() == mask
        seqs.append(prompt + resp)
        masks.append(mask)
    scored = w.engine.score(seqs, starts)
    behaviour = torch.split(td["behaviour_logprobs"], td["response_lens"].tolist())
    for mask, lp, ref in zip(masks, behaviour, scored):
        pos = [j for j, m in enumerate(mask) if m]
        torch.testing.assert_close(lp[pos], torch.tensor([ref[j] for j in pos]), atol=1e-4, rtol=0)
    m = w.roller.last_metrics
    assert m["env/turns_mean"] == 2.0 and m["env/tool_call_rate"] == 1.0 and m["env/tool_errors"] == 0


@pytest.mark.timeout(120)
def test_hanging_and_raising_tools_are_bounded_counted_and_the_worker_goes_on(tiny_run):
    import time

    run = tiny_run("env.name=env_plugins:flaky_tools", "env.tool_timeout_s=0.5", "env.max_tool_calls=2",
                   "rollout.group_size=2",
                   "rollout.prompts_per_batch=1")
    w = run.worker
    start = time.monotonic()
    for _ in range(2):
        td = w.roller.rollout_batch(0)
        validate_trajectories(td)
    assert time.monotonic() - start < 30
    c = w.roller.last_metrics
    # 2 batches x 2 episodes, each calling both tools once: 4 timeouts, 4 errors.
    assert (c["env/tool_calls_total"], c["env/tool_timeouts_total"], c["env/tool_errors_total"]) == (8, 4, 4)
    assert c["env/tool_errors"] == 4.0 and c["env/turns_mean"] == 2.0  # the episodes went on to answer


@pytest.mark.timeout(120)
def test_version_change_between_turns_is_recorded_per_token(tiny_run):
    """The learner publishes v1 while turn 1's tool runs; the worker loads it before turn 2
    (rollout.inflight_updates) and the trajectory says so token by token."""
    run = tiny_run("env.name=env_plugins:learner_step_between_turns", "rollout.engine=hf_fast",
                   "rollout.inflight_updates=true", "rollout.group_size=2", "rollout.prompts_per_batch=1")
    w = run.worker
    env_plugins.BETWEEN_TURNS.append(lambda: run.publish(1))
    td = w.roller.rollout_batch(0)
    validate_trajectories(td)
    assert w.subscriber.loaded_version == 1
    lens = td["response_lens"].tolist()
    for versions, mask in zip(torch.split(td["policy_version"], lens), torch.split(td["response_mask"], lens)):
        (a, b), = _reply_spans(mask.tolist())
        assert versions.tolist() == [0] * b + [1] * (len(mask) - b)  # turn 1 + reply at v0, turn 2 at v1


# ---- the whole run ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_streamrl_launch_runs_tiny_tools(repo, tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "streamrl.launcher.launch", "--config", str(repo / TINY_TOOLS), "--steps", "3",
                           f"run.run_dir={run_dir}"], cwd=repo, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert summary["accounting"]["lost_total"] == 0
