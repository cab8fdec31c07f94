"""The critic role: a value model in its own process learns from the batches workers send it
(value loss falls, explained variance > 0.3) and survives SIGKILL (restart, resume from its
checkpoint). The learner's ``learner.advantage = gae`` computes its advantages from the values.

Real parts: a real ``streamrl.workers.critic_server`` process, real Redis, ZeroMQ, the worker's
role hook (:func:`trajectory_roles`), the tiny task's prompts and its real reward function.
The responses come from a scripted policy of mixed skill (exact copies, random digits, letters)
so the rewards vary enough to learn a value from within seconds on CPU.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess

import pytest
import torch
from safetensors import safe_open

from streamrl.algorithms.advantages import gae_advantages
from streamrl.config import load_config
from streamrl.coord.coordinator import Coordinator
from streamrl.models.tokenizer import build_char_tokenizer
from streamrl.rewards import build_reward
from streamrl.roles.annotate import trajectory_roles
from streamrl.roles.critic import ROLE, critic_checkpoint_path
from streamrl.roles.token_client import TokenRoleClient
from streamrl.roles.token_wire import TOKEN_KEYS
from streamrl.tasks import build_task
from streamrl.trajectory import pack_trajectories, validate_trajectories

from test_checkpoint import REPO
from test_reference_role import wait_published

CKPT_EVERY = 5


def scripted_batch(cfg, rng: random.Random, n: int = 32):
    """``n`` copy-digits trajectories answered by a policy of mixed skill, scored by the task's reward."""
    tok, task = build_char_tokenizer(), build_task(cfg.task)
    reward = build_reward(cfg.rollout.rewards, task)
    problems = [task.sample(rng) for _ in range(n)]
    texts = []
    for p in problems:
        kind = rng.random()
        texts.append(p.answer if kind < 0.4 else "".join(rng.choice("0123456789") for _ in p.answer)
                     if kind < 0.7 else "".join(rng.choice("abcdefghij") for _ in p.answer))
    rewards, _ = reward.score(problems, texts)
    prompts = [tok.encode(p.prompt, add_special_tokens=False) for p in problems]
    resp = [tok.encode(t, add_special_tokens=False) for t in texts]
    return pack_trajectories(prompts, resp, [[-1.0] * len(r) for r in resp], [[0] * len(r) for r in resp],
                             rewards, list(range(n)), list(range(n)), 0, 0.0)


def explained_variance(td, values: torch.Tensor, cfg) -> tuple[float, float]:
    """(explained variance of the GAE returns, value loss) of ``values [R]`` on batch ``td``."""
    lens = td["response_lens"]
    grid = torch.zeros(len(lens), int(lens.max()))
    o = 0
    for i, r in enumerate(lens.tolist()):
        grid[i, :r] = values[o:o + r]
        o += r
    _, ret = gae_advantages(grid, td["reward"], lens, cfg.critic.gamma, cfg.critic.lam)
    mask = torch.arange(grid.shape[1])[None, :] < lens[:, None]
    g, v = ret[mask], grid[mask]
    return 1.0 - float((g - v).var(unbiased=False) / g.var(unbiased=False)), float(0.5 * ((g - v) ** 2).mean())


@pytest.fixture
def critic_cfg(tmp_path):
    return load_config(f"{REPO}/configs/tiny.yaml", [
        "placement.critic=[cpu]", "learner.advantage=gae", "critic.lr=3e-3", "critic.lam=1.0",
        f"critic.checkpoint_every={CKPT_EVERY}", f"checkpoint.dir={tmp_path / 'ckpt'}"])


def start_critic(redis_url, run_id, python, repo, log_path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen([python, "-m", "streamrl.workers.critic_server", "--redis-url", redis_url,
                                 "--run-id", run_id], cwd=repo, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "STREAMRL_THREADS": "1"})


@pytest.fixture
def critic_process(redis_url, run_id, critic_cfg, python, repo, tmp_path):
    coord = Coordinator(redis_url, run_id)
    coord.put_config(critic_cfg.to_dict())
    procs = [start_critic(redis_url, run_id, python, repo, tmp_path / "critic.log")]
    try:
        wait_published(procs[0], coord, ROLE, tmp_path / "critic.log")
        yield procs, coord
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        coord.close()


def _train(roles, cfg, rng, batches: int) -> int:
    """Send ``batches`` scripted batches through the worker's role hook; the last critic version."""
    version = 0
    for _ in range(batches):
        td = roles(scripted_batch(cfg, rng))
        validate_trajectories(td)
        version = int(td["critic_version"][0])
    return version


def test_critic_process_learns_the_value_of_the_tiny_task(critic_process, critic_cfg):
    """Held-out batch (sent without rewards: scored, not trained on): at the start V = 0 (EV 0);
    after 40 batches the value loss has fallen and the explained variance is > 0.3."""
    procs, coord = critic_process
    rng = random.Random(0)
    held_out = scripted_batch(critic_cfg, random.Random(99), n=64)
    probe = TokenRoleClient(ROLE, lambda: coord.get_endpoint(ROLE), timeout_s=60)
    roles = trajectory_roles(critic_cfg, coord)
    try:
        values, version = probe({k: held_out[k] for k in TOKEN_KEYS})
        ev0, loss0 = explained_variance(held_out, values, critic_cfg)
        assert version == 0 and ev0 == pytest.approx(0.0, abs=1e-6)
        version = _train(roles, critic_cfg, rng, 40)
        values, _ = probe({k: held_out[k] for k in TOKEN_KEYS})
        ev, loss = explained_variance(held_out, values, critic_cfg)
    finally:
        probe.close()
        roles.close()
    assert version >= 39  # trains after replying: the reply to batch k carries version k-1 or k
    assert loss < 0.5 * loss0 and ev > 0.3, (loss0, loss, ev)
    assert procs[0].poll() is None


@pytest.mark.slow
def test_critic_survives_sigkill_and_resumes_from_its_checkpoint(critic_process, critic_cfg, redis_url, run_id,
                                                                 python, repo, tmp_path):
    """Train, SIGKILL the critic, start it again (as the supervisor does): it resumes at its
    checkpointed step with its learned values (EV stays > 0.3), and the worker's client finds
    the new endpoint by itself and training continues from there."""
    procs, coord = critic_process
    rng = random.Random(1)
    held_out = scripted_batch(critic_cfg, random.Random(99), n=64)
    roles = trajectory_roles(critic_cfg, coord, timeout_s=5)
    try:
        _train(roles, critic_cfg, rng, 40)
        ckpt = critic_checkpoint_path(critic_cfg)
        with safe_open(str(ckpt), framework="pt") as f:
            saved = int(f.metadata()["step"])
        assert saved >= 35 and saved % CKPT_EVERY == 0
        procs[0].kill()
        procs[0].wait(10)
        coord.r.delete(coord.keys.endpoint(ROLE))  # as after a restart: the old address is gone
        procs.append(start_critic(redis_url, run_id, python, repo, tmp_path / "critic.log"))
        wait_published(procs[1], coord, ROLE, tmp_path / "critic.log")
        probe = TokenRoleClient(ROLE, lambda: coord.get_endpoint(ROLE), timeout_s=60)
        try:
            values, version = probe({k: held_out[k] for k in TOKEN_KEYS})
        finally:
            probe.close()
        assert version == saved
        assert explained_variance(held_out, values, critic_cfg)[0] > 0.3
        roles.clients[ROLE].attempts = 30  # the old socket's request times out, the endpoint is read anew
        assert _train(roles, critic_cfg, rng, 2) >= saved + 1
    finally:
        roles.close()


def test_learner_gae_advantages_from_served_values(critic_cfg):
    """``learner.advantage = gae``: the learner's advantages are the whitened GAE of the batch's
    ``values`` (hand-checked on one row); a batch without values is an error naming the fix."""
    from streamrl.learner.trainer import Trainer
    from streamrl.bench.padded_reference import packed_gradients
    from streamrl.learner.step_inputs import batch_advantages, batch_response_grid

    td = scripted_batch(critic_cfg, random.Random(3), n=8)
    td["values"] = torch.linspace(0.0, 1.0, td["response_tokens"].numel())
    trainer = Trainer(critic_cfg)
    grid = batch_response_grid(td, trainer.critic)
    adv = batch_advantages(trainer.cfg, td, grid)
    assert adv.shape == grid.loss_mask.shape
    raw, _ = gae_advantages(torch.tensor([[0.5, 0.25, 0.0]]), torch.tensor([1.0]), torch.tensor([3]), 1.0, 0.5)
    # deltas: 0.25-0.5, 0-0.25, 1-0 -> A2 = 1, A1 = -0.25 + 0.5, A0 = -0.25 + 0.5 * 0.25
    assert raw[0].tolist() == pytest.approx([-0.125, 0.25, 1.0])
    m = grid.loss_mask.bool()
    assert float(adv[m].mean()) == pytest.approx(0.0, abs=1e-5) and float(adv[m].std(unbiased=False)) == \
        pytest.approx(1.0, abs=1e-3)
    metrics = packed_gradients(trainer, td)
    assert metrics["learner/loss"] == metrics["learner/loss"]  # finite
    del td["values"]
    with pytest.raises(ValueError, match="placement.critic"):
        packed_gradients(trainer, td)
