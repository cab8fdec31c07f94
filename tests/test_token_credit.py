"""Token-level credit: task character credit -> per-token rewards -> wire -> reward-to-go advantages."""
from __future__ import annotations

import json
import math
import random
import subprocess
import time

import pytest
import torch

from streamrl.algorithms.advantages import group_advantages, token_group_advantages
from streamrl.config import ConfigError, load_config
from streamrl.rewards import build_reward, token_rewards
from streamrl.tasks import get_task
from streamrl.tasks.registry import Problem
from streamrl.trajectory import TrajectoryError, pack_trajectories, to_padded, validate_trajectories

DIGIT_TASKS = ("copy_digits", "reverse_digits", "sort_digits")


def _random_response(rng: random.Random, answer: str) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        return answer
    if kind == 1:  # some positions wrong
        return "".join(c if rng.random() < 0.5 else rng.choice("0123456789") for c in answer)
    if kind == 2:  # whitespace around, letters inside
        return " " * rng.randrange(3) + "".join(rng.choice("0123456789ab ") for _ in answer) + " " * rng.randrange(2)
    if kind == 3:  # too long / too short
        return answer + "".join(rng.choice("0123456789x") for _ in range(rng.randrange(1, 4)))
    return answer[: rng.randrange(len(answer) + 1)]


# --- tasks -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", DIGIT_TASKS)
def test_digit_credit_sums_to_the_scalar_reward(name):
    task = get_task(name, num_digits=4)
    rng = random.Random(0)
    for _ in range(300):
        p = task.sample(rng)
        r = _random_response(rng, p.answer)
        credit = task.token_credit(p, r)
        assert len(credit) == len(r)
        lead = len(r) - len(r.lstrip())
        cut = lead + len(p.answer)  # characters past the answer's length carry the length penalty
        assert all(c >= 0 for c in credit[:cut]) and all(c <= 0 for c in credit[cut:])
        assert math.isclose(sum(credit), task.reward(p, r), rel_tol=0, abs_tol=1e-12), (p, r)


def test_digit_credit_sits_on_the_characters_that_earned_it():
    task = get_task("copy_digits", num_digits=4)
    p = Problem("1234=", "1234")
    # ' 1x34' strips to '1x34' (n = 4): '1' right+digit, 'x' nothing, '3','4' right+digit.
    assert task.token_credit(p, " 1x34") == pytest.approx([0.0, 0.25, 0.0, 0.25, 0.25])
    # a wrong digit earns only the format share 0.2 / 4
    assert task.token_credit(p, "1299") == pytest.approx([0.25, 0.25, 0.05, 0.05])
    # too long: reward 1.0 * 4/6; the 1/3 shortfall sits on the two extra characters
    assert task.token_credit(p, "123456") == pytest.approx([0.25] * 4 + [-1 / 6] * 2)


# --- rewards -> tokens --------------------------------------------------------------------

class _PieceTokenizer:
    """Tokenizer twin whose tokens are text pieces: '' pieces are special tokens, and 'é' is
    split over two tokens whose prefix decodes only once both are there (like byte-level BPE)."""

    eos_token_id = 0

    def __init__(self, pieces):
        self.pieces = pieces

    def _decode(self, ids):
        text, pending = "", False
        for i in ids:
            piece = self.pieces[i]
            if piece == "<half>":
                pending = True
                continue
            text += ("é" if pending else "") + piece
            pending = False
        return text

    def batch_decode(self, seqs, skip_special_tokens=True):
        return [self._decode(s) for s in seqs]


def test_token_rewards_follow_decoded_text_and_skip_specials():
    tok = _PieceTokenizer(["", "12", "3", "<half>", "x", "9"])  # id 0 = EOS (special)
    ids = [1, 3, 4, 2, 0]  # '12' + 'é' (from <half> and 'x' -> 'éx') + '3' + EOS
    text = tok._decode(ids)
    assert text == "12éx3"
    credit = [0.1, 0.2, 0.3, 0.4, 0.5]
    out = token_rewards(tok, ids, credit, terminal=0.05)
    # '1','2' -> token 0; 'é','x' -> token 2 (the token completing them; <half> gets 0); '3' -> token 3
    assert out == pytest.approx([0.3, 0.0, 0.7, 0.5, 0.05])
    assert sum(out) == pytest.approx(sum(credit) + 0.05)


def test_combined_reward_credits_task_and_terminal_remainder():
    from streamrl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    task = get_task("copy_digits", num_digits=4)
    reward = build_reward("task=1.0,format=0.5", task)  # 'format' has no character credit
    problems = [Problem("1234=", "1234")] * 3
    texts = ["1234", "1299", "12a"]
    totals, _ = reward.score(problems, texts)
    chars, terminal = reward.credits(problems, texts, totals)
    for text, total, c, t in zip(texts, totals, chars, terminal):
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        out = token_rewards(tok, ids, c, t)
        assert len(out) == len(ids)
        assert sum(out) == pytest.approx(total, abs=1e-12)
        # one char = one token: the task's credit lands on the digits, 'format' on the EOS
        assert out[: len(text)] == pytest.approx(task.token_credit(problems[0], text))
        fmt = 0.5 * float(text.isdigit())
        assert out[-1] == pytest.approx(fmt, abs=1e-12)


# --- advantages ----------------------------------------------------------------------------

@pytest.mark.parametrize("normalize_std", [True, False])
def test_scalar_reward_at_last_token_is_exactly_grpo(normalize_std):
    g = torch.Generator().manual_seed(0)
    b, t = 24, 11
    group_id = torch.arange(b) // 4 * 7 + 3  # 6 groups with arbitrary ids
    # Same prompt length within a group (same prompt), ragged response lengths.
    p_len = (torch.randint(1, 4, (b // 4,), generator=g)).repeat_interleave(4)
    r_len = torch.randint(1, t - 3, (b,), generator=g)
    reward = torch.rand(b, generator=g)
    reward[4:8] = 0.5  # one group with equal rewards -> 0, never 0/0
    pos = torch.zeros(b, t, dtype=torch.bool)
    tr = torch.zeros(b, t)
    for i in range(b):
        pos[i, p_len[i] - 1: p_len[i] - 1 + r_len[i]] = True
        tr[i, p_len[i] - 2 + r_len[i]] = reward[i]
    got = token_group_advantages(tr, pos, group_id, normalize_std)
    want = group_advantages(reward, group_id, normalize_std)[:, None] * pos
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert (got[4:8] == 0).all()


def test_hand_computed_two_groups_two_samples_three_tokens():
    # group 5: r = [1,0,0] and [0,0,1]; group 9: [0,1,1] and [0,0,0].
    tr = torch.tensor([[1., 0., 0.], [0., 0., 1.], [0., 1., 1.], [0., 0., 0.]])
    pos = torch.ones(4, 3, dtype=torch.bool)
    gid = torch.tensor([5, 5, 9, 9])
    # returns-to-go G: [1,0,0], [1,1,1], [2,2,1], [0,0,0]
    # group 5: mean per position [1, .5, .5]; sequence returns 1, 1 -> std 0 -> all 0
    # group 9: mean per position [1, 1, .5]; sequence returns 2, 0 -> std sqrt(2)
    s = math.sqrt(2)
    want_std = torch.tensor([[0., 0., 0.], [0., 0., 0.], [1 / s, 1 / s, .5 / s], [-1 / s, -1 / s, -.5 / s]])
    want_centred = torch.tensor([[0., -.5, -.5], [0., .5, .5], [1., 1., .5], [-1., -1., -.5]])
    torch.testing.assert_close(token_group_advantages(tr, pos, gid, True), want_std, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(token_group_advantages(tr, pos, gid, False), want_centred)


def test_advantages_align_by_response_position_and_hold_last_value():
    # Same group, response starts at column 1 and 2 (the function aligns by response index).
    tr = torch.tensor([[0., 1., 2., 0.], [0., 0., 3., 0.]])
    pos = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    out = token_group_advantages(tr, pos, torch.tensor([0, 0]), False)
    # aligned rewards [1, 2] and [3, 0]: G = [3, 2] and [3, 0]; means [3, 1]
    assert out.tolist() == [[0., 0., 1., 0.], [0., 0., 0., -1.]]
    with pytest.raises(ValueError, match="response position"):
        token_group_advantages(tr, torch.zeros(2, 4, dtype=torch.bool), torch.tensor([0, 0]))


# --- trajectory contract, wire ----------------------------------------------------------------

def _batch(token_rewards=None):
    resp = [[10, 11, 2], [12, 2]]
    tr = token_rewards if token_rewards is not None else [[0.25, 0.0, 0.5], [0.0, 0.125]]
    return pack_trajectories([[5, 6, 7], [5, 6, 7]], resp, [[-0.5, -0.1, -0.2], [-1.0, -0.2]], [[3] * 3, [3] * 2],
                             [0.75, 0.1], [7, 7], [100, 101], 1, 123.5, token_rewards=tr)


def test_to_padded_aligns_token_rewards_with_training_positions():
    td = _batch()
    validate_trajectories(td)
    padded = to_padded(td, pad_id=0)
    # prompt of 3: response token j is predicted at position 2 + j
    assert padded["token_rewards"].tolist() == [[0, 0, 0.25, 0, 0.5], [0, 0, 0, 0.125, 0]]
    assert padded["response_positions"].tolist() == [[False, False, True, True, True],
                                                     [False, False, True, True, False]]
    assert (padded["response_positions"] >= padded["loss_mask"].bool()).all()


@pytest.mark.parametrize("bad, reason", [
    (lambda td: td["token_rewards"].__setitem__(1, float("nan")), "non_finite"),
    (lambda td: td["token_rewards"].__setitem__(0, float("inf")), "non_finite"),
    (lambda td: td.__setitem__("token_rewards", torch.zeros(4)), "bad_shape"),  # R is 5
    (lambda td: td.__setitem__("token_rewards", torch.zeros(5, dtype=torch.float64)), "bad_dtype"),
])
def test_malformed_token_rewards_rejected_with_reason(bad, reason):
    td = _batch()
    bad(td)
    with pytest.raises(TrajectoryError) as e:
        validate_trajectories(td)
    assert e.value.reason == reason and "token_rewards" in str(e.value)


def test_token_rewards_cross_the_real_wire_and_bad_ones_are_counted():
    from streamrl.transport.receiver import TrajectoryReceiver
    from streamrl.transport.sender import TrajectorySender

    rx = TrajectoryReceiver("tcp://127.0.0.1:*", hwm=8)
    tx = TrajectorySender(rx.endpoint, worker_id=1, hwm=8)
    try:
        good = _batch()
        nan = _batch()
        nan["token_rewards"][2] = float("nan")
        short = _batch()
        short["token_rewards"] = short["token_rewards"][:4].clone()
        for td in (nan, short, good):
            assert tx.send(td, timeout_s=10)
        got, deadline = [], time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            got += rx.poll(0.2)
        assert len(got) == 1
        assert torch.equal(got[0]["token_rewards"], good["token_rewards"])
        stats = rx.stats()
        assert stats["transport/rejected_non_finite"] == 1 and stats["transport/rejected_bad_shape"] == 1
    finally:
        tx.close()
        rx.close()


def _broadcast(rank, world):
    from streamrl.learner.distributed import broadcast_batch

    td = broadcast_batch(_batch() if rank == 0 else None)
    return td["token_rewards"].clone()


@pytest.mark.timeout(120)
def test_broadcast_batch_carries_token_rewards_to_every_rank():
    from tests.dist_helpers import spawn_gloo

    for got in spawn_gloo(_broadcast, 2, timeout_s=100):
        assert torch.equal(got, _batch()["token_rewards"])


# --- config, rollout, learner step -------------------------------------------------------------

def test_config_names_the_field(repo):
    with pytest.raises(ConfigError, match="learner.advantage"):
        load_config(f"{repo}/configs/tiny.yaml", ["learner.advantage=tokens"])
    with pytest.raises(ConfigError, match="learner.advantage"):
        load_config(f"{repo}/configs/tiny.yaml", ["learner.advantage=token", "learner.loss=gspo"])
    cfg = load_config(f"{repo}/configs/tiny-token.yaml")
    assert cfg.learner.advantage == "token" and cfg.rollout.token_rewards


def test_roller_sends_token_rewards_and_learner_steps_on_them(repo, monkeypatch):
    from streamrl.engines.factory import build_engine
    from streamrl.learner.trainer import Trainer
    from streamrl.models.factory import build_model
    from streamrl.tasks.registry import problem_stream
    from streamrl.rollout.factory import build_roller

    monkeypatch.chdir(repo)
    torch.manual_seed(0)
    cfg = load_config("configs/tiny-token.yaml", ["rollout.group_size=4", "rollout.prompts_per_batch=2",
                                                  f"run.run_dir={repo}/runs/_unused"])
    model, tok = build_model(cfg.model, seed=0)
    task = get_task(cfg.task.name, num_digits=cfg.task.num_digits)
    roller = build_roller(cfg, build_engine(cfg, model, tok), tok, problem_stream(task, 0, 0, 1), worker_id=0)
    td = roller.rollout_batch(version=0)
    validate_trajectories(td)
    assert td["token_rewards"].shape == td["response_tokens"].shape
    r_lens = td["response_lens"].tolist()
    sums = torch.stack([x.sum() for x in td["token_rewards"].split(r_lens)])
    torch.testing.assert_close(sums, td["reward"], rtol=0, atol=1e-6)
    eos = td["response_tokens"] == tok.eos_token_id
    assert (td["token_rewards"][eos].abs() < 1e-6).all()  # the task's credit leaves EOS at 0

    tr = Trainer(cfg)
    m = tr.step(td)
    assert math.isfinite(m["learner/loss"]) and m["learner/advantage_abs_mean"] >= 0
    del td["token_rewards"]
    with pytest.raises(ValueError, match="token_rewards"):
        tr.step(td)
    with pytest.raises(ConfigError, match="rollout.token_rewards"):
        Trainer(load_config("configs/tiny.yaml", ["learner.advantage=token"]))


# --- the loop ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_token_credit_loop_learns(tmp_path, repo, python):
    run_dir = tmp_path / "tok"
    proc = subprocess.run(
        [python, "-m", "streamrl.launcher.launch", "--config", str(repo / "configs/tiny.yaml"), "--learners", "2",
         "--rollers", "2", "--steps", "40", "--run-dir", str(run_dir), "rollout.token_rewards=true",
         "learner.advantage=token"],
        cwd=repo, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 40
    assert summary["transport"]["transport/rejected"] == 0
    assert summary["reward_last"] > summary["reward_first"] + 0.08, summary


def test_scored_text_shows_special_tokens_and_stops_at_eos():
    # '9<pad>5' must not score as '95': the policy wrote a pad token there (a reward leak when hidden)
    from streamrl.config import ModelConfig
    from streamrl.models.factory import load_model_and_tokenizer
    from streamrl.rewards import decoded_prefix_lengths, response_texts

    _, tok = load_model_and_tokenizer(ModelConfig(), seed=0)
    nine, five = tok.encode("95", add_special_tokens=False)
    ids = [nine, tok.pad_token_id, five, tok.eos_token_id, five]
    assert response_texts(tok, [ids, [five]]) == ["9<pad>5", "5"]
    assert decoded_prefix_lengths(tok, ids) == [1, 6, 7, 7, 7]
    from streamrl.tasks import get_task
    from streamrl.tasks.registry import Problem

    task = get_task("copy_digits", num_digits=2)
    leaky = task.reward(Problem("95=", "95"), tok.decode(ids[:3], skip_special_tokens=True))
    assert leaky == 1.0 and task.reward(Problem("95=", "95"), response_texts(tok, [ids])[0]) < 0.5
