"""The reward-model role: a tiny random HF reward model served by its own process over ZeroMQ.

Real parts throughout: a real ``streamrl.workers.reward_server`` process, real Redis (the
session fixture), real DEALER/ROUTER sockets. The in-process twin (:class:`RewardServer` in a
thread) covers what needs a deterministic batch boundary or a quick restart.
"""
from __future__ import annotations

import signal
import subprocess
import threading
import time

import pytest
import torch
import zmq

from streamrl.config import Config
from streamrl.coord.coordinator import Coordinator
from streamrl.launcher.process import ManagedProcess
from streamrl.rewards import build_reward
from streamrl.roles.reward_client import RewardClient, RewardServerError, RewardServerTimeout
from streamrl.roles.reward_model import HFRewardModel
from streamrl.roles.reward_server import RewardServer
from streamrl.roles.reward_wire import ENDPOINT, LIMITS, decode_reply, decode_request, encode_request
from streamrl.tasks.registry import Problem
from streamrl.transport.codec import FrameError, encode

PROMPTS = ["What is 2 + 3?", "Name a colour.", "A longer prompt, with more words in it than the others here."]
RESPONSES = ["5", "blue <pad> or green, ü", "The answer is 47."]
OTHER_PROMPTS = ["Spell cat.", "Say hi"]
OTHER_RESPONSES = ["c-a-t", ""]


def _byte_tokenizer():
    """A byte-level tokenizer with no merges (257 ids): a real fast tokenizer, tiny."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<pad>"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>")


def _make_folder(path, causal: bool) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tok = _byte_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    (LlamaForCausalLM if causal else LlamaForSequenceClassification)(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory) -> str:
    return _make_folder(tmp_path_factory.mktemp("rm"), causal=False)


@pytest.fixture(scope="module")
def rm(rm_folder) -> HFRewardModel:
    return HFRewardModel(rm_folder)


def test_folder_kinds_score_in_process(rm, tmp_path):
    """Both folder kinds load and score one float per pair; padding does not change a score's
    pooling position (the classifier pools at each pair's own last token)."""
    scores = rm(PROMPTS, RESPONSES)
    assert len(scores) == 3 and all(isinstance(s, float) for s in scores)
    assert len(set(scores)) == 3
    alone = [rm([p], [r])[0] for p, r in zip(PROMPTS, RESPONSES)]
    assert scores == pytest.approx(alone, abs=1e-6)
    lm = HFRewardModel(_make_folder(tmp_path / "lm", causal=True))
    assert lm.kind == "causal"
    mean_logp = lm(PROMPTS, RESPONSES)
    assert all(s < 0 for s in mean_logp[:1])  # a mean log-probability of the response tokens
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"architectures": ["BertModel"]}')
    with pytest.raises(ValueError, match="rollout.reward_model"):
        HFRewardModel(str(tmp_path / "bad"))


def test_build_reward_combines_folder_model_with_rule_rewards(rm_folder, rm):
    fn = build_reward("format=0.5,reward_model=2.0", reward_model=rm_folder)
    problems = [Problem(p, "5") for p in PROMPTS]
    totals, comps = fn.score(problems, RESPONSES)
    expect = rm(PROMPTS, RESPONSES)
    assert [row[-1] for row in comps] == expect
    assert totals == pytest.approx([0.5 * row[0] + 2.0 * s for row, s in zip(comps, expect)])
    assert fn.names == ["format", "reward_model"]
    with pytest.raises(ValueError, match="rollout.reward_model is not set"):
        build_reward("format=0.5,reward_model=2.0")


def test_wire_round_trip_and_rejections():
    rid, p, r = decode_request(encode_request(7, PROMPTS, RESPONSES))
    assert (rid, p, r) == (7, PROMPTS, RESPONSES)
    assert decode_request(encode_request(8, [], [])) == (8, [], [])
    bad_offsets = encode({"prompt_bytes": torch.tensor([104, 105], dtype=torch.uint8),
                          "prompt_offsets": torch.tensor([0, 5], dtype=torch.int64),
                          "response_bytes": torch.tensor([111], dtype=torch.uint8),
                          "response_offsets": torch.tensor([0, 1], dtype=torch.int64)}, "reward_request", {"id": 1})
    with pytest.raises(FrameError) as e:
        decode_request(bad_offsets)
    assert e.value.reason == "bad_texts"
    not_utf8 = encode({"prompt_bytes": torch.tensor([255], dtype=torch.uint8),
                       "prompt_offsets": torch.tensor([0, 1], dtype=torch.int64),
                       "response_bytes": torch.tensor([111], dtype=torch.uint8),
                       "response_offsets": torch.tensor([0, 1], dtype=torch.int64)}, "reward_request", {"id": 1})
    with pytest.raises(FrameError, match="UTF-8"):
        decode_request(not_utf8)
    with pytest.raises(FrameError) as e:
        decode_request([b"not json", b""])
    assert e.value.reason == "bad_header"
    assert LIMITS.max_ndim == 1


def test_server_batches_requests_that_arrive_together(rm):
    """Two workers' requests waiting at once are scored in one forward and each gets its own
    slice, equal to the in-process model on that same merged batch. (inproc: a sent message is
    in the server's pipe when send returns, so "waiting at once" is a fact, not a race.)"""
    server = RewardServer(rm, bind="inproc://reward-batching")
    workers = [server.ctx.socket(zmq.DEALER) for _ in range(2)]
    try:
        for w, (rid, p, r) in zip(workers, ((1, PROMPTS, RESPONSES), (2, OTHER_PROMPTS, OTHER_RESPONSES))):
            w.connect(server.endpoint)
            w.send_multipart(encode_request(rid, p, r))
        assert server.serve_once(5000) == 5
        replies = [decode_reply(w.recv_multipart()) for w in workers]
        merged = rm(PROMPTS + OTHER_PROMPTS, RESPONSES + OTHER_RESPONSES)
        assert replies == [(1, merged[:3], None), (2, merged[3:], None)]
        assert (server.batches, server.requests, server.pairs) == (1, 2, 5)
    finally:
        for w in workers:
            w.close(0)
        server.close()


def test_client_times_out_with_a_clear_error_and_finds_a_restarted_server(rm):
    endpoint = {"now": None}
    client = RewardClient(lambda: endpoint["now"], timeout_s=0.3, attempts=2)
    with pytest.raises(RewardServerTimeout, match="endpoint not published"):
        client(PROMPTS, RESPONSES)
    first = RewardServer(rm)
    endpoint["now"] = first.endpoint
    stop = threading.Event()
    thread = threading.Thread(target=first.serve, args=(stop.is_set,))
    thread.start()
    try:
        client.timeout_s = 5
        assert client(PROMPTS, RESPONSES) == rm(PROMPTS, RESPONSES)
    finally:
        stop.set(), thread.join(5), first.close()
    client.timeout_s = 0.3
    with pytest.raises(RewardServerTimeout, match=first.endpoint):
        client(PROMPTS, RESPONSES)
    second = RewardServer(rm)  # a new port, republished: the client reads it after a timeout
    endpoint["now"] = second.endpoint
    stop.clear()
    thread = threading.Thread(target=second.serve, args=(stop.is_set,))
    thread.start()
    try:
        client.timeout_s = 5
        assert client(OTHER_PROMPTS, OTHER_RESPONSES) == rm(OTHER_PROMPTS, OTHER_RESPONSES)
    finally:
        stop.set(), thread.join(5), second.close(), client.close()


def test_model_failure_is_an_error_reply_not_a_dead_server(rm):
    calls = []

    def flaky(prompts, responses):
        calls.append(len(prompts))
        if len(calls) == 1:
            raise RuntimeError("out of memory (simulated by the test's score function)")
        return rm(prompts, responses)

    server = RewardServer(flaky)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop.is_set,))
    thread.start()
    client = RewardClient(server.endpoint, timeout_s=5)
    try:
        with pytest.raises(RewardServerError, match="out of memory"):
            client(PROMPTS, RESPONSES)
        assert client(PROMPTS, RESPONSES) == rm(PROMPTS, RESPONSES)
        assert server.errors == 1
    finally:
        stop.set(), thread.join(5), server.close(), client.close()


@pytest.fixture
def reward_process(redis_url, run_id, rm_folder, python, tmp_path):
    """A real reward-server process for this run, its config (reward_model = the folder) in Redis."""
    cfg = Config()
    cfg.rollout.reward_model = rm_folder
    coord = Coordinator(redis_url, run_id)
    coord.put_config(cfg.to_dict())
    server = ManagedProcess("reward", [python, "-m", "streamrl.workers.reward_server", "--redis-url", redis_url,
                                       "--run-id", run_id], tmp_path / "reward.log", env={"STREAMRL_THREADS": "1"})
    server.start()
    try:
        coord.wait_endpoint(ENDPOINT, timeout_s=60)
        yield server.proc, coord
    finally:
        server.stop(grace_s=10)
        coord.close()


def test_reward_process_serves_two_clients_and_survives_malformed_frames(reward_process, rm):
    """The issue's test: one reward-server process, two workers' clients, the scores of the model
    run in-process; garbage on the socket is rejected, counted (monitor metrics) and survived."""
    proc, coord = reward_process
    resolve = lambda: coord.get_endpoint(ENDPOINT)  # noqa: E731 (what a rollout worker passes)
    a, b = RewardClient(resolve, timeout_s=30), RewardClient(resolve, timeout_s=30)
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    try:
        # sequential requests: each is its own batch on the server, so scores are bit-equal
        assert a(PROMPTS, RESPONSES) == rm(PROMPTS, RESPONSES)
        assert b(OTHER_PROMPTS, OTHER_RESPONSES) == rm(OTHER_PROMPTS, OTHER_RESPONSES)
        # concurrent requests may share one forward; a shared padded batch moves float32 sums by
        # rounding only (measured ~1e-8 on this model), never a score's pooling position
        out = {}
        threads = [threading.Thread(target=lambda: out.__setitem__("a", a(PROMPTS, RESPONSES))),
                   threading.Thread(target=lambda: out.__setitem__("b", b(OTHER_PROMPTS, OTHER_RESPONSES)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert out["a"] == pytest.approx(rm(PROMPTS, RESPONSES), abs=1e-6)
        assert out["b"] == pytest.approx(rm(OTHER_PROMPTS, OTHER_RESPONSES), abs=1e-6)

        rogue.connect(resolve())
        rogue.send_multipart([b"{not json", b""])
        rogue.send_multipart(encode({"prompt_bytes": torch.tensor([1, 2], dtype=torch.uint8),
                                     "prompt_offsets": torch.tensor([0, 9], dtype=torch.int64),
                                     "response_bytes": torch.tensor([], dtype=torch.uint8),
                                     "response_offsets": torch.tensor([0, 0], dtype=torch.int64)},
                                    "reward_request", {"id": 1}))
        assert a(PROMPTS, RESPONSES) == rm(PROMPTS, RESPONSES)  # still serving
        deadline = time.monotonic() + 30
        while True:  # counters reach Redis every 2 s
            m = coord.latest_metrics().get("reward", {})
            if m.get("reward/rejected") == 2:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.2)
        assert m["reward/rejected_bad_header"] == 1 and m["reward/rejected_bad_texts"] == 1
        assert m["reward/pairs"] >= 3 + 2 + 5 + 3
        assert proc.poll() is None
        # what a worker builds: the rule rewards plus the served model, weighted in the spec
        spec, problems = "format=0.5,reward_model=2.0", [Problem(p, "5") for p in PROMPTS]
        served = build_reward(spec, reward_model=rm.folder, reward_endpoint=resolve).score(problems, RESPONSES)
        assert served == build_reward(spec, reward_model=rm.folder).score(problems, RESPONSES)
    finally:
        rogue.close(0), ctx.term(), a.close(), b.close()
    coord.request_stop("test done")
    assert proc.wait(30) == 0


def test_launcher_starts_the_reward_role_where_placed(redis_url, run_id, repo, rm_folder):
    """``--place reward=cpu`` with ``rollout.reward_model`` set: the launcher's process list has a
    supervised ``reward`` process whose command the real entry point parses; without the model
    (or without the placement) there is none."""
    from streamrl.launcher import launch, runner
    from streamrl.launcher.runstate import RunState
    from streamrl.workers import reward_server

    def processes(*extra):
        args = launch.parse_args(["--config", str(repo / "configs/tiny.yaml"), "--run-id", run_id, *extra])
        lc = launch.prepare(args)
        coord = Coordinator(redis_url, run_id)
        try:
            return runner._processes(lc, redis_url, RunState(coord, run_id))[1]
        finally:
            coord.close()

    placed = [p for p in processes("--place", "reward=cpu", f"rollout.reward_model={rm_folder}") if p.name == "reward"]
    assert len(placed) == 1
    cmd = placed[0].cmd
    args = reward_server.parse_args(cmd[cmd.index("streamrl.workers.reward_server") + 1:])
    assert (args.redis_url, args.run_id, args.device) == (redis_url, run_id, "cpu")
    assert not [p for p in processes("--place", "reward=cpu") if p.name == "reward"]
    assert not [p for p in processes(f"rollout.reward_model={rm_folder}") if p.name == "reward"]


@pytest.mark.slow
def test_client_survives_sigkill_and_restart_of_the_reward_process(reward_process, rm, redis_url, run_id, python,
                                                                   repo, tmp_path):
    """SIGKILL the real server, start another (new port, republished): the same client, after
    its timeout, reads the new endpoint and gets the in-process scores again."""
    proc, coord = reward_process
    client = RewardClient(lambda: coord.get_endpoint(ENDPOINT), timeout_s=2, attempts=60)
    try:
        assert client(PROMPTS, RESPONSES) == rm(PROMPTS, RESPONSES)
        old = coord.get_endpoint(ENDPOINT)
        proc.kill()
        proc.wait(10)
        coord.r.delete(coord.keys.endpoint(ENDPOINT))  # as after a restart: the old address is gone
        with open(tmp_path / "reward2.log", "wb") as log:
            second = subprocess.Popen([python, "-m", "streamrl.workers.reward_server", "--redis-url", redis_url,
                                       "--run-id", run_id], cwd=repo, stdout=log, stderr=subprocess.STDOUT)
        try:
            assert client(OTHER_PROMPTS, OTHER_RESPONSES) == rm(OTHER_PROMPTS, OTHER_RESPONSES)
            assert client.endpoint != old and client.resends >= 1
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
    finally:
        client.close()
