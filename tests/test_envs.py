"""Multi-turn episodes with tools: the calculator, tool-call parsing, bounded tools,
and the episode driver on a real engine (tiny random model, character tokenizer, ``hf`` engine).
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from streamrl.config import ModelConfig
from streamrl.envs.base import FunctionEnv, StepResult
from streamrl.envs.episode import EpisodeLimits, episode_metrics, episodes_to_trajectories, run_episodes
from streamrl.envs.render import ChatTemplateRenderer, PlainTextRenderer
from streamrl.envs.tool_env import ToolEnv
from streamrl.envs.tools import (Calculator, CalculatorError, HermesToolParser, ToolCall, ToolRegistry, ToolRunner,
                                 evaluate_arithmetic)
from streamrl.trajectory import to_padded, validate_trajectories

SMOL = os.path.join(os.path.dirname(__file__), "..", "models", "smol")
TOOL_REPLY = "=42 "  # characters the char tokenizer knows


# ---- calculator ---------------------------------------------------------------------------

@pytest.mark.parametrize("expr,value", [("12+3*4", 24), ("(12+3)*4", 60), ("7//2", 3), ("7/2", 3.5), ("-5%3", 1),
                                        ("123456789*987654321", 121932631112635269), ("1.5*2", 3.0)])
def test_calculator_evaluates_arithmetic(expr, value):
    assert evaluate_arithmetic(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "x+1", "2**100000", "abs(-1)", "(lambda: 1)()",
                                  "[1][0]", "1 if 1 else 2", "'a'*3", "True+1", "1/0", "9" * 300, "1+"])
def test_calculator_refuses_everything_else(expr):
    with pytest.raises(CalculatorError):
        evaluate_arithmetic(expr)


def test_calculator_service_formats_integers():
    assert Calculator()(expression="6/3") == {"result": "2"}


# ---- tool-call parsing --------------------------------------------------------------------

def test_hermes_parser_reads_calls_in_order_and_flags_bad_ones():
    text = ('let me compute <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
            '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}\n</tool_call>'
            '<tool_call>{"name": oops}</tool_call>')
    r = HermesToolParser()(text)
    assert [c.tool for c in r["calls"]] == ["calculator", "calculator", HermesToolParser.INVALID]
    assert r["calls"][0].args == {"expression": "2*3"} and r["calls"][1].args == {"expression": "1+1"}
    assert r["text"] == "let me compute"
    assert HermesToolParser()("the answer is 6")["calls"] == []


# ---- bounded tools ------------------------------------------------------------------------

class _Hang:
    name = "hang"

    def __init__(self):
        self.release, self.entered = threading.Event(), threading.Event()

    def __call__(self, **_):
        self.entered.set()
        self.release.wait(60)
        return {"result": "late"}


class _Raise:
    name = "boom"

    def __call__(self, **_):
        raise RuntimeError("tool exploded")


class _Meet:
    """Two calls must be inside the tool at the same time, else the barrier breaks: proves concurrency."""
    name = "meet"

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=10)

    def __call__(self, **_):
        self.barrier.wait()
        return {"result": "met"}


def test_hanging_and_raising_tools_are_bounded_and_counted():
    hang = _Hang()
    runner = ToolRunner(ToolRegistry([hang, _Raise(), Calculator()]), timeout_s=0.5, max_workers=4)
    try:
        start = time.monotonic()
        out = runner.run([ToolCall("hang", {}), ToolCall("boom", {}), ToolCall("calculator", {"expression": "2+2"}),
                          ToolCall("nope", {}), ToolCall("calculator", {"wrong": "1"})])
        elapsed = time.monotonic() - start
        assert hang.entered.is_set()
        assert [r.status for r in out] == ["timeout", "error", "ok", "error", "error"]
        assert "tool exploded" in out[1].content and out[2].content == '{"result": "4"}'
        assert elapsed < 0.5 + 2.0, f"a hanging tool held the caller {elapsed:.2f} s"
        c = runner.counters()
        assert (c["env/tool_calls_total"], c["env/tool_errors_total"], c["env/tool_timeouts_total"], c["env/tools_hung"]) == (5, 3, 1, 1)
    finally:
        hang.release.set()
        runner.close()


def test_tool_calls_run_concurrently():
    runner = ToolRunner(ToolRegistry([_Meet()]), timeout_s=10, max_workers=2)
    try:
        assert [r.status for r in runner.run([ToolCall("meet", {}), ToolCall("meet", {})])] == ["ok", "ok"]
    finally:
        runner.close()


def test_tool_env_turns_calls_into_tool_messages_then_scores_the_answer():
    runner = ToolRunner(ToolRegistry([Calculator(), _Raise()]), timeout_s=2)
    env = ToolEnv(lambda p: [{"role": "user", "content": p["q"]}], lambda p, text: float(text.strip() == p["a"]),
                  runner, max_calls_per_turn=2)
    try:
        assert env.reset({"q": "123*456?", "a": "56088"}) == [{"role": "user", "content": "123*456?"}]
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>'
        boom = '<tool_call>{"name": "boom", "arguments": {}}</tool_call>'
        r = env.step(call + boom + call)
        assert not r.done and r.reward == 0.0
        assert [m["content"] for m in r.messages][0] == '{"result": "56088"}'
        assert "tool exploded" in r.messages[1]["content"] and "more than 2 calls" in r.messages[2]["content"]
        assert (r.info["tool_calls"], r.info["tool_errors"]) == (3.0, 2.0) and r.info["tool_latency_s"] >= 0
        final = env.step("56088")
        assert final.done and final.reward == 1.0
    finally:
        runner.close()


# ---- the episode driver on a real engine --------------------------------------------------

@pytest.fixture(scope="module")
def engine_and_tok():
    from streamrl.engines.hf import HFEngine
    from streamrl.models.factory import build_model

    model, tok = build_model(ModelConfig(max_positions=256), seed=5)
    return HFEngine(model, tok), tok


def _two_turn_env():
    """Turn 1 is always answered by a tool-like reply; turn 2 ends the episode with reward 1."""
    def step(problem, turns):
        if len(turns) == 1:
            return StepResult([{"role": "tool", "content": TOOL_REPLY}], 0.0, False, {"tool_calls": 1.0})
        return StepResult([], 1.0, True)
    return FunctionEnv(lambda p: [{"role": "user", "content": p}], step)


def test_two_turn_episode_masks_tool_tokens_and_matches_teacher_forcing(engine_and_tok):
    eng, tok = engine_and_tok
    renderer = PlainTextRenderer(tok)
    reply = tok.encode(TOOL_REPLY, add_special_tokens=False)
    versions = iter([3, 4])  # a weight update lands between the two turns
    torch.manual_seed(0)
    problems = ["12+34=", "5*6=", "999+1="]
    eps = run_episodes(eng, [_two_turn_env() for _ in problems], problems, renderer, tok.decode, tok.eos_token_id,
                       EpisodeLimits(max_turns=4, max_turn_tokens=6, max_response_tokens=64), temperature=1.0,
                       before_turn=lambda: next(versions))
    for ep in eps:
        assert ep.turns == 2 and ep.stop == "done" and ep.reward == 1.0
        first = ep.mask.index(False)
        n_env = len(reply)
        # Exactly the tool reply is masked out, with log-prob 0, sitting between the two model turns.
        assert ep.response[first:first + n_env] == reply and ep.mask[first:first + n_env] == [False] * n_env
        assert all(ep.mask[:first]) and all(ep.mask[first + n_env:]) and len(ep.response) > first + n_env
        assert ep.logprobs[first:first + n_env] == [0.0] * n_env
        assert ep.versions == [3] * (first + n_env) + [4] * (len(ep.response) - first - n_env)
    # Model tokens' behaviour log-probs equal teacher forcing over the whole conversation.
    scored = eng.score([ep.prompt + ep.response for ep in eps], [len(ep.prompt) for ep in eps])
    for ep, ref in zip(eps, scored):
        model_pos = [j for j, m in enumerate(ep.mask) if m]
        torch.testing.assert_close(torch.tensor([ep.logprobs[j] for j in model_pos]),
                                   torch.tensor([ref[j] for j in model_pos]), atol=1e-4, rtol=0)
    # The trajectory contract holds and the learner's loss mask excludes the tool tokens.
    td = episodes_to_trajectories(eps, group_ids=[0, 0, 1], traj_ids=[1, 2, 3], worker_id=0)
    validate_trajectories(td)
    padded = to_padded(td, pad_id=tok.pad_token_id)
    for i, ep in enumerate(eps):
        p = len(ep.prompt)
        assert padded["loss_mask"][i, p - 1:p - 1 + len(ep.response)].bool().tolist() == ep.mask
    m = episode_metrics(eps)
    assert m["env/turns_mean"] == 2.0 and m["env/tool_calls"] == 3.0 and m["env/stop_done"] == 3.0
    assert m["env/tool_call_rate"] == 1.0


def test_episode_limits_cut_turns_and_tokens(engine_and_tok):
    eng, tok = engine_and_tok
    never_done = FunctionEnv(lambda p: [{"role": "user", "content": p}],
                             lambda p, turns: StepResult([{"role": "tool", "content": TOOL_REPLY}], 0.5, False))
    torch.manual_seed(1)
    by_turns = run_episodes(eng, [never_done], ["1+1="], PlainTextRenderer(tok), tok.decode, tok.eos_token_id,
                            EpisodeLimits(max_turns=3, max_turn_tokens=4, max_response_tokens=200))[0]
    assert by_turns.stop == "max_turns" and by_turns.turns == 3 and by_turns.reward == 1.5
    by_tokens = run_episodes(eng, [never_done], ["1+1="], PlainTextRenderer(tok), tok.decode, tok.eos_token_id,
                             EpisodeLimits(max_turns=50, max_turn_tokens=4, max_response_tokens=20))[0]
    assert by_tokens.stop == "max_tokens" and len(by_tokens.response) <= 20


def test_hanging_tool_inside_an_episode_is_bounded_and_counted(engine_and_tok):
    """A real engine drives a ToolEnv whose first turn calls a hanging and a raising tool."""
    eng, tok = engine_and_tok
    hang = _Hang()
    runner = ToolRunner(ToolRegistry([hang, _Raise()]), timeout_s=0.3)
    seen = []

    def parser(text):  # the random model cannot write tool calls: the first turn "calls" both tools
        seen.append(text)
        calls = [ToolCall("hang", {}), ToolCall("boom", {})] if len(seen) == 1 else []
        return {"text": text, "calls": calls, "meta": {}}

    env = ToolEnv(lambda p: [{"role": "user", "content": p}], lambda p, text: 1.0, runner, parser=parser)
    renderer = PlainTextRenderer(tok, template="{role}:{content} ")  # error texts hold unknown chars -> <unk>
    try:
        ep = run_episodes(eng, [env], ["3*3="], renderer, tok.decode, tok.eos_token_id,
                          EpisodeLimits(max_turns=3, max_turn_tokens=4, max_response_tokens=400))[0]
        assert ep.stop == "done" and ep.turns == 2 and ep.reward == 1.0
        assert (ep.info["tool_calls"], ep.info["tool_errors"]) == (2.0, 2.0)
        c = runner.counters()
        assert (c["env/tool_timeouts_total"], c["env/tool_errors_total"]) == (1, 1)
    finally:
        hang.release.set()
        runner.close()


@pytest.mark.skipif(not os.path.isdir(SMOL), reason="models/smol not prepared (streamrl-prepare-model)")
def test_chat_template_reply_tokens_continue_the_conversation():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOL)
    r = ChatTemplateRenderer(tok)
    user = [{"role": "user", "content": "What is 12*34?"}]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
    tool = [{"role": "tool", "content": '{"result": "408"}'}]
    # As the driver builds it: prompt, the sampled turn ending with <|im_end|>, the rendered reply.
    tokens = r.prompt_tokens(user) + tok.encode(call, add_special_tokens=False) + [tok.eos_token_id]
    tokens += r.env_tokens(tool, model_ended=True)
    whole = tok.apply_chat_template(user + [{"role": "assistant", "content": call}] + tool, tokenize=True,
                                    add_generation_prompt=True, return_dict=False)
    assert tokens == list(whole)


# ---- the large-arithmetic calculator task -------------------------------------------------

def test_tiny_calculator_episode_rewards_calling_the_tool_and_copying_the_result():
    import random

    from streamrl.envs.calculator_task import TINY_REPLY, LargeArithmetic, calculator_runner, tiny_calculator_env
    from streamrl.models.tokenizer import build_char_tokenizer

    task = LargeArithmetic(num_digits=6)
    problem = task.sample(random.Random(0))
    runner = calculator_runner()
    try:
        env = tiny_calculator_env(task, runner)
        assert env.reset(problem) == [{"role": "user", "content": problem.prompt}]
        call = env.step(f"c:{problem.fields['expression']}")
        assert not call.done and call.messages == [{"role": "tool", "content": problem.answer}]
        # The reply renders in the character vocabulary (no <unk>).
        tok = build_char_tokenizer()
        ids = PlainTextRenderer(tok, template=TINY_REPLY).env_tokens(call.messages, model_ended=True)
        assert tok.unk_token_id not in ids and tok.decode(ids) == f"={problem.answer} "
        assert env.step(problem.answer).reward == 1.0
        env.reset(problem)
        assert env.step("c:1+*").messages == [{"role": "tool", "content": "error"}]
        assert env.step("12").reward < 0.2
        # A bare "c" calls the calculator on the problem itself (the format a random tiny model finds).
        shaped = tiny_calculator_env(task, runner, call_reward=0.1)
        shaped.reset(problem)
        first, again = shaped.step("c?x"), shaped.step("c")
        assert first.messages == again.messages == [{"role": "tool", "content": problem.answer}]
        assert (first.reward, again.reward) == (0.1, 0.0)  # the call reward is paid once per episode
    finally:
        runner.close()


def test_chat_calculator_env_speaks_hermes():
    import random

    from streamrl.envs.calculator_task import LargeArithmetic, calculator_runner, chat_calculator_env

    task = LargeArithmetic(num_digits=4, ops="+")
    problem = task.sample(random.Random(1))
    runner = calculator_runner()
    try:
        env = chat_calculator_env(task, runner)
        msgs = env.reset(problem)
        assert msgs[0]["role"] == "system" and "<tool_call>" in msgs[0]["content"]
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
        r = env.step(call % problem.fields["expression"])
        assert r.messages == [{"role": "tool", "content": '{"result": "%s"}' % problem.answer}]
        assert env.step(problem.answer).reward == 1.0  # the number only, as the system prompt asks
    finally:
        runner.close()


# ---- in-flight weight updates inside and between turns ------------------------------------

def test_hf_fast_versions_change_inside_and_between_turns():
    """An update lands mid turn 1 (engine-stamped) and the next turn starts at the new version;
    every model token's log-prob is its version's teacher forcing."""
    import copy

    from streamrl.engines.hf import HFEngine
    from streamrl.engines.hf_fast import FastHFEngine
    from streamrl.engines.hf_fast_config import FastHFConfig
    from streamrl.models.factory import build_model

    model, tok = build_model(ModelConfig(max_positions=256), seed=7)
    v0 = copy.deepcopy(model).eval()
    g = torch.Generator().manual_seed(11)
    new = [(n, p.detach() + 0.5 * torch.randn(p.shape, generator=g)) if n == "lm_head.weight" else (n, p.detach())
           for n, p in model.named_parameters()]
    v1 = copy.deepcopy(model).eval()
    v1.load_state_dict(dict(new), strict=False)
    eng = FastHFEngine(model, tok, FastHFConfig(batch_size=2, max_seq_len=128,
                                                eos_token_id=-1))  # turns run to the token cap
    calls, loaded = [], [10]

    def between_steps():  # the update arrives before decode step 3 of the first turn
        calls.append(None)
        if len(calls) == 4:
            loaded[0] = 11
            return 11, new
        return None

    torch.manual_seed(0)
    eps = run_episodes(eng, [_two_turn_env() for _ in range(2)], ["12+34=", "7*8="], PlainTextRenderer(tok),
                       tok.decode, tok.eos_token_id, EpisodeLimits(max_turns=2, max_turn_tokens=6),
                       before_turn=lambda: loaded[0], between_steps=between_steps)
    n_env = len(tok.encode(TOOL_REPLY, add_special_tokens=False))
    for ep in eps:
        assert ep.versions == [10] * 3 + [11] * 3 + [11] * n_env + [11] * 6
        full = ep.prompt + ep.response
        ref = {v: HFEngine(m, tok).score([full], [len(ep.prompt)])[0] for v, m in ((10, v0), (11, v1))}
        want = [ref[v][j] for j, v in enumerate(ep.versions) if ep.mask[j]]
        torch.testing.assert_close(torch.tensor([lp for lp, m in zip(ep.logprobs, ep.mask) if m]),
                                   torch.tensor(want), atol=1e-4, rtol=0)


# ---- a worker batch of tool episodes ------------------------------------------------------

def test_episode_batch_roller_packs_groups_of_tool_episodes(engine_and_tok):
    import itertools
    import random

    from streamrl.envs.calculator_task import TINY_REPLY, LargeArithmetic, calculator_runner, tiny_calculator_env
    from streamrl.envs.roller import EpisodeBatchRoller

    eng, tok = engine_and_tok
    task, rng, ids = LargeArithmetic(num_digits=3), random.Random(0), itertools.count(1)
    runner = calculator_runner()
    roller = EpisodeBatchRoller(eng, tok, iter(lambda: task.sample(rng), None), lambda: tiny_calculator_env(task, runner),
                                PlainTextRenderer(tok, template=TINY_REPLY), EpisodeLimits(2, 8, 40), lambda: next(ids),
                                prompts_per_batch=2, group_size=3, runner=runner)
    try:
        torch.manual_seed(0)
        td = roller.rollout_batch(version=5)
        m = roller.last_metrics
        validate_trajectories(td, max_version=5)
        assert td["group_id"].tolist()[:3] == [td["group_id"][0].item()] * 3 and len(set(td["group_id"].tolist())) == 2
        assert len(set(td["traj_id"].tolist())) == 6 and (td["policy_version"] == 5).all()
        assert 1.0 <= m["env/turns_mean"] <= 2.0 and m["env/tool_calls_total"] == m["env/tool_calls"]
    finally:
        roller.close()
        runner.close()


# ---- the Python tool ----------------------------------------------------------------------

def test_python_tool_runs_code_in_a_fresh_limited_process():
    from streamrl.envs.python_tool import PythonTool

    tool = PythonTool(timeout_s=1.0, memory_mb=256)
    assert tool(code="print(6*7)") == {"stdout": "42\n", "stderr": "", "returncode": 0}
    assert tool(code="import sys; sys.modules['x'] = 1; X = 5")["returncode"] == 0
    assert "NameError" in tool(code="print(X)")["stderr"]  # nothing survives between calls
    assert tool(code="raise SystemExit(3)")["returncode"] == 3
    assert tool(code="b = bytearray(512 << 20)")["returncode"] != 0  # above the address-space limit
    start = time.monotonic()
    hung = tool(code="while True: pass")
    assert hung["returncode"] == -9 and "timed out" in hung["stderr"] and time.monotonic() - start < 1.0 + 3.0
    runner = ToolRunner(ToolRegistry([tool]), timeout_s=5.0)
    try:
        out = runner.run([ToolCall("python", {"code": "print(sum(range(10)))"}), ToolCall("python", {"code": 1})])
        assert out[0].output["stdout"] == "45\n" and out[1].status == "error"
    finally:
        runner.close()


# ---- what the learner makes of an episode batch -------------------------------------------

def test_learner_trains_only_the_model_tokens_of_an_episode(engine_and_tok):
    """The unchanged trainer, on a batch of two-turn episodes: tool tokens are not trained tokens,
    and whatever behaviour log-prob they carry does not change the gradient."""
    from streamrl.config import load_config
    from streamrl.learner.trainer import Trainer
    from streamrl.bench.padded_reference import packed_gradients

    from test_checkpoint import REPO

    eng, tok = engine_and_tok
    torch.manual_seed(2)
    problems = ["12+34=", "5*6=", "999+1=", "8-3="]
    eps = run_episodes(eng, [_two_turn_env() for _ in problems], problems, PlainTextRenderer(tok), tok.decode,
                       tok.eos_token_id, EpisodeLimits(max_turns=2, max_turn_tokens=6))
    for j, ep in enumerate(eps):
        ep.reward = float(j % 2)  # two groups of two with different rewards: non-zero advantages
    td = episodes_to_trajectories(eps, group_ids=[0, 0, 1, 1], traj_ids=[1, 2, 3, 4], worker_id=0)
    tr = Trainer(load_config(f"{REPO}/configs/tiny.yaml", ["learner.lr=1e-3"]))
    packed_gradients(tr, td)
    grads = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    env = ~td["response_mask"]
    assert env.sum() == len(eps) * len(tok.encode(TOOL_REPLY, add_special_tokens=False))
    td["behaviour_logprobs"][env] = -7.0  # a wrong value on tool tokens must not matter
    packed_gradients(tr, td)
    for n, p in tr.model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[n], atol=1e-7, rtol=0)
    assert any(g.abs().sum() > 0 for g in grads.values())


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(SMOL), reason="models/smol not prepared (streamrl-prepare-model)")
def test_smol_two_turn_chat_episode_matches_teacher_forcing():
    """SmolLM2 with its chat template: the tool reply is rendered by the template (closing a turn
    cut by the token limit), and model tokens keep their teacher-forced log-probs."""
    from streamrl.engines.hf import HFEngine
    from streamrl.models.factory import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(ModelConfig(path=SMOL))
    eng = HFEngine(model, tok)
    renderer = ChatTemplateRenderer(tok)

    def step(problem, turns):
        if len(turns) == 1:
            return StepResult([{"role": "tool", "content": '{"result": "408"}'}], 0.0, False)
        return StepResult([], float("408" in turns[-1]), True)

    torch.manual_seed(0)
    problems = ["What is 12*34? Use the calculator.", "Compute 12 times 34."]
    envs = [FunctionEnv(lambda p: [{"role": "user", "content": p}], step) for _ in problems]
    eps = run_episodes(eng, envs, problems, renderer, lambda t: tok.decode(t), tok.eos_token_id,
                       EpisodeLimits(max_turns=2, max_turn_tokens=12, max_response_tokens=128))
    scored = eng.score([ep.prompt + ep.response for ep in eps], [len(ep.prompt) for ep in eps])
    for ep, ref in zip(eps, scored):
        assert ep.turns == 2
        env_text = tok.decode([t for t, m in zip(ep.response, ep.mask) if not m])
        assert "<|im_start|>tool\n" in env_text and env_text.endswith("<|im_start|>assistant\n")
        pos = [j for j, m in enumerate(ep.mask) if m]
        torch.testing.assert_close(torch.tensor([ep.logprobs[j] for j in pos]), torch.tensor([ref[j] for j in pos]),
                                   atol=2e-4, rtol=0)
