"""Streaming rollouts: ``FastHFEngine.generate_stream`` (slots refilled from a callback, rows handed
over as they finish) and :class:`streamrl.rollout.stream.StreamingRoller` (whole groups admitted,
scored and sent ``prompts_per_batch`` at a time). Tiny random models on CPU."""
from __future__ import annotations

import itertools

import pytest
import torch

from streamrl.config import ModelConfig, load_config
from streamrl.engines.factory import build_engine
from streamrl.engines.hf_fast import FastHFEngine
from streamrl.engines.hf_fast_config import FastHFConfig
from streamrl.models import build_model
from streamrl.rollout.factory import build_roller
from streamrl.rollout.stream import StreamingRoller
from streamrl.tasks import get_task
from streamrl.tasks.registry import problem_stream
from streamrl.trajectory import validate_trajectories

MAX_NEW = 24


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 60, (k,), generator=g).tolist() for k in torch.randint(2, 10, (n,), generator=g).tolist()]


def _long_tail(n: int, every: int) -> list[int]:
    """Caps: one long request in every ``every``, the rest short (the shape of reasoning lengths)."""
    return [MAX_NEW if i % every == 0 else 3 for i in range(n)]


@pytest.fixture(scope="module")
def tiny():
    model, tok = build_model(ModelConfig(), seed=1)
    return model.eval(), tok


def _engine(tiny, batch: int, sync_every: int = 2) -> FastHFEngine:
    model, tok = tiny
    return FastHFEngine(model, tok, FastHFConfig(batch_size=batch, max_seq_len=48, sync_every=sync_every,
                                                 eos_token_id=-1))


def _stream(eng, prompts, caps, chunk=None, **kw):
    """``generate_stream`` over ``prompts`` handed in as slots free (at most ``chunk`` a call);
    returns ``(results by request, refill calls, requests served)``."""
    queue, calls, got = list(range(len(prompts))), [], {}

    def refill(free):
        calls.append(free)
        if not queue:
            return None
        take = [queue.pop(0) for _ in range(min(free, chunk or free, len(queue)))]
        return [prompts[j] for j in take]

    def on_finished(j, tokens, logprobs, versions, routed):
        assert j not in got, f"request {j} finished twice"
        got[j] = (tokens, logprobs, versions)

    served = eng.generate_stream(refill, on_finished, MAX_NEW, temperature=0.0,
                                 max_tokens=lambda j: caps[j], **kw)
    return got, calls, served


def test_stream_is_bit_identical_to_generate_greedy(tiny):
    """13 requests through 4 slots, mixed caps: the stream's rows equal ``generate``'s exactly."""
    prompts, caps = _prompts(13), _long_tail(13, 4)
    want = _engine(tiny, 4).generate(prompts, MAX_NEW, temperature=0.0, max_tokens=caps)
    got, calls, served = _stream(_engine(tiny, 4), prompts, caps)
    assert served == 13 and sorted(got) == list(range(13))
    for j in range(13):
        assert got[j][0] == want.tokens[j], j
        assert got[j][1] == want.logprobs[j], j  # bit-identical: the same fills in the same slots
        assert len(got[j][0]) == caps[j]
    assert all(0 < free <= 4 for free in calls)  # asked only with free slots, never for more than there are


def test_stream_refills_long_tail_in_fewer_decode_steps(tiny):
    """4 batches of 8 (one long request each): the batch path decodes each batch to its longest;
    the stream keeps the 4 long requests running side by side and the short ones around them."""
    prompts, caps = _prompts(32, seed=2), _long_tail(32, 8)
    batch_eng = _engine(tiny, 8)
    for b in range(4):
        batch_eng.generate(prompts[8 * b: 8 * b + 8], MAX_NEW, temperature=0.0, max_tokens=caps[8 * b: 8 * b + 8])
    stream_eng = _engine(tiny, 8)
    got, _, served = _stream(stream_eng, prompts, caps)
    assert served == 32 and all(len(got[j][0]) == caps[j] for j in range(32))
    assert batch_eng.decode_steps >= 4 * (MAX_NEW - 1)
    assert stream_eng.decode_steps < 0.5 * batch_eng.decode_steps, (stream_eng.decode_steps, batch_eng.decode_steps)


def test_refill_none_drains_and_empty_refills_wait(tiny):
    """``[]`` means nothing now (asked again), None means no more: the held rows finish, then it returns."""
    prompts, caps = _prompts(5, seed=3), _long_tail(5, 2)
    replies = iter([prompts[:2], [], [], prompts[2:5], None])
    got = {}
    eng = _engine(tiny, 4)
    served = eng.generate_stream(lambda free: next(replies), lambda j, t, lp, v, r: got.__setitem__(j, t),
                                 MAX_NEW, temperature=0.0, max_tokens=lambda j: caps[j])
    assert served == 5 and sorted(got) == list(range(5))
    assert all(len(got[j]) == caps[j] for j in range(5))
    with pytest.raises(ValueError, match="at most"):
        _engine(tiny, 2).generate_stream(lambda free: _prompts(free + 1), lambda *a: None, MAX_NEW)


def test_stream_versions_follow_inflight_updates(tiny):
    """``between_steps`` loads a version mid-stream: rows carry per-token versions across it."""
    model, _ = tiny
    params = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    calls = itertools.count()
    hook = lambda: (8, params) if next(calls) == 5 else None  # noqa: E731
    got, _, _ = _stream(_engine(tiny, 4), _prompts(9, seed=4), [MAX_NEW] * 9, between_steps=hook, version=7)
    seen = {v for _, _, vs in got.values() for v in vs}
    assert seen == {7, 8}
    for tokens, _, vs in got.values():
        assert len(vs) == len(tokens) and vs == sorted(vs)


# -- the roller ---------------------------------------------------------------------------------
def _roller(repo, monkeypatch, *extra):
    monkeypatch.chdir(repo)
    cfg = load_config("configs/tiny.yaml", ["rollout.engine=hf_fast", "rollout.streaming=true",
                                            "rollout.group_size=3", "rollout.prompts_per_batch=2",
                                            "rollout.max_new_tokens=6", *extra])
    model, tok = build_model(cfg.model, seed=0)
    engine = build_engine(cfg, model, tok)
    task = get_task(cfg.task.name, num_digits=cfg.task.num_digits)
    roller = build_roller(cfg, engine, tok, problem_stream(task, 0, 0, 1), worker_id=2)
    assert isinstance(roller, StreamingRoller)
    return cfg, engine, roller


def test_roller_sends_whole_groups_and_loses_none(repo, monkeypatch):
    """7 groups granted one or two at a time: messages of 2 groups (the drain sends the last one),
    every group whole in one message, every sample once, its group admitted within the free slots."""
    cfg, engine, roller = _roller(repo, monkeypatch)
    g, budget, asked, sent = cfg.rollout.group_size, [7], [], []

    def reserve(k):
        asked.append(k)
        n = min(k, budget[0], 1 + len(asked) % 2)
        budget[0] -= n
        return n

    caps = _long_tail(7 * g, 5)
    groups = roller.run(reserve, sent.append, version=3, stop=lambda: budget[0] == 0,
                        max_tokens=lambda j: caps[j])
    assert groups == 7 and [int(td["reward"].numel()) for td in sent] == [6, 6, 6, 3]
    assert all(1 <= k <= engine.batch // g for k in asked)
    gids, tids = [], []
    for td in sent:
        validate_trajectories(td)
        gid = td["group_id"].tolist()
        assert all(gid.count(x) == g for x in set(gid))  # whole groups only
        gids += sorted(set(gid))
        tids += td["traj_id"].tolist()
        assert (td["policy_version"] == 3).all()
        assert not td["reward"].is_inference() and not td["response_tokens"].is_inference()
    assert len(set(gids)) == 7 and len(set(tids)) == 7 * g  # none lost, none duplicated
    assert 0 < roller.last_metrics["rollout/slot_occupancy"] <= 1 and "rollout/truncated" in roller.last_metrics


def test_roller_stopped_at_once_sends_nothing(repo, monkeypatch):
    _, _, roller = _roller(repo, monkeypatch)
    sent = []
    assert roller.run(lambda k: pytest.fail("reserved after stop"), sent.append, version=0, stop=lambda: True) == 0
    assert sent == []


def test_streaming_config_needs_hf_fast(repo, monkeypatch):
    from streamrl.config import ConfigError

    monkeypatch.chdir(repo)
    with pytest.raises(ConfigError, match="rollout.streaming"):
        load_config("configs/tiny.yaml", ["rollout.streaming=true", "rollout.engine=hf"])


def test_bench_streaming_compares_both_paths_on_the_same_tokens(tiny):
    """``streamrl-bench rollout --streaming``'s comparison: same requests and caps on both paths,
    the stream in fewer decode steps with fuller slots."""
    from streamrl.bench.rollout import bench_streaming

    prompts = [p for p in _prompts(8, seed=5) for _ in range(4)]
    row = bench_streaming(_engine(tiny, 8), prompts, group_size=4, max_new=MAX_NEW, temperature=1.0, repeats=1)
    assert row["requests"] == 32 and row["tokens"] > 0 and row["same_tokens"]
    assert row["stream_decode_steps"] < row["batch_decode_steps"]
    assert row["stream_slot_occupancy"] > row["batch_slot_occupancy"] and row["ratio_stream_vs_batch"] > 0
