"""The rollout worker's multi-turn roller from the config's ``env`` section.

``env.name`` picks the environment every sample plays:

* ``calculator``: the large-arithmetic calculator task (:mod:`streamrl.envs.calculator_task`);
  the character tokenizer gets the ``c``-prefix format, a chat model the Hermes ``<tool_call>``
  format;
* ``python``: a chat model answers the task's question and may run Python
  (:class:`~streamrl.envs.python_tool.PythonTool`) through Hermes ``<tool_call>`` blocks;
* ``package.module:function``: a plug-in called as ``function(cfg, tokenizer, runner)`` once per
  episode, returning an :class:`~streamrl.envs.base.Environment`; ``runner`` is the worker's
  shared :class:`~streamrl.envs.tools.ToolRunner` (calculator and python registered), so the
  plug-in's tool calls are bounded and counted like the built-ins'.

The final answer is scored by the worker's configured reward (``rollout.rewards``), the same
object single-turn batches use.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Iterator

from streamrl.envs.calculator_task import TINY_REPLY, chat_calculator_env, tiny_calculator_env
from streamrl.envs.episode import EpisodeLimits
from streamrl.envs.python_tool import PythonTool
from streamrl.envs.render import ChatTemplateRenderer, PlainTextRenderer, Renderer
from streamrl.envs.roller import EpisodeBatchRoller
from streamrl.envs.tool_env import ToolEnv
from streamrl.envs.tools import Calculator, HermesToolParser, ToolRegistry, ToolRunner
from streamrl.rollout.prompts import uses_chat_template
from streamrl.tasks import build_task

PYTHON_SYSTEM_PROMPT = (
    "You can run Python. To run a program, write exactly\n"
    '<tool_call>{"name": "python", "arguments": {"code": "<program>"}}</tool_call>\n'
    "and stop; what it prints comes back in a tool message. When you know the answer, reply with it only."
)
# Hung in-process tools keep their pool thread (see ToolRunner); this many may hang before new calls queue.
TOOL_THREADS = 32


def load_env_plugin(spec: str) -> Callable[..., Any]:
    """``package.module:function`` -> the function; ValueError naming ``env.name`` if it fails."""
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"env.name = {spec!r}: cannot load the plug-in ({type(e).__name__}: {e})") from e
    if not callable(obj):
        raise ValueError(f"env.name = {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return obj


def tool_runner(cfg) -> ToolRunner:
    """The worker's tools: calculator and python, each call bounded by ``env.tool_timeout_s``."""
    timeout = cfg.env.tool_timeout_s
    return ToolRunner(ToolRegistry([Calculator(), PythonTool(timeout_s=timeout)]), timeout_s=timeout,
                      max_workers=TOOL_THREADS)


def build_renderer(cfg, tok) -> Renderer:
    """Chat template for chat models; for the character tokenizer, tool replies as ``=result ``."""
    return ChatTemplateRenderer(tok) if uses_chat_template(tok, cfg.rollout.chat_template) else PlainTextRenderer(tok, template=TINY_REPLY)


def env_maker(cfg, tok, runner: ToolRunner, reward) -> Callable[[], Any]:
    """A zero-argument function making a fresh environment per episode.

    reward: the worker's :class:`streamrl.rewards.CombinedReward` (``score(problems, texts)``).
    """
    ec = cfg.env

    def score(problem, text: str) -> float:
        return float(reward.score([problem], [text])[0][0])

    if ec.name == "calculator":
        if cfg.task.name != "large_arithmetic":
            raise ValueError(f"env.name = 'calculator' needs task.name = 'large_arithmetic', not {cfg.task.name!r}")
        task = build_task(cfg.task)
        make = chat_calculator_env if uses_chat_template(tok, cfg.rollout.chat_template) else tiny_calculator_env
        return lambda: make(task, runner, ec.max_tool_calls, reward_fn=score, call_reward=ec.call_reward)
    if ec.name == "python":
        if not uses_chat_template(tok, cfg.rollout.chat_template):
            raise ValueError("env.name = 'python' needs a chat model (rollout.chat_template = true and a tokenizer "
                             "with a chat template): its tool calls are Hermes <tool_call> blocks")

        def prompt(problem):
            return [{"role": "system", "content": PYTHON_SYSTEM_PROMPT}, {"role": "user", "content": problem.prompt}]
        return lambda: ToolEnv(prompt, score, runner, parser=HermesToolParser(), max_calls_per_turn=ec.max_tool_calls,
                               call_reward=ec.call_reward)
    plugin = load_env_plugin(ec.name)
    return lambda: plugin(cfg, tok, runner)


def build_episode_roller(cfg, engine, tok, problems: Iterator[Any], worker_id: int, next_id: Callable[[], int],
                         reward, before_turn: Callable[[], int] | None = None) -> EpisodeBatchRoller:
    """The multi-turn counterpart of :class:`streamrl.rollout.batch.BatchRoller` for ``cfg.env.name != 'none'``."""
    rc, ec = cfg.rollout, cfg.env
    if ec.name == "none":
        raise ValueError("env.name = 'none': single-turn batches use streamrl.rollout.batch.BatchRoller")
    for name in ("token_rewards", "record_routing"):
        if getattr(rc, name):
            raise ValueError(f"rollout.{name} = true is not supported with env.name = {ec.name!r} (multi-turn)")
    if ec.max_total_tokens < rc.max_new_tokens:
        raise ValueError(f"env.max_total_tokens = {ec.max_total_tokens}: must be >= rollout.max_new_tokens "
                         f"= {rc.max_new_tokens} (one full model turn)")
    runner = tool_runner(cfg)
    limits = EpisodeLimits(max_turns=ec.max_turns, max_turn_tokens=rc.max_new_tokens,
                           max_response_tokens=ec.max_total_tokens)
    return EpisodeBatchRoller(engine, tok, problems, env_maker(cfg, tok, runner, reward), build_renderer(cfg, tok),
                              limits, next_id, prompts_per_batch=rc.prompts_per_batch, group_size=rc.group_size,
                              temperature=rc.temperature, worker_id=worker_id, runner=runner, before_turn=before_turn,
                              lanes=ec.lanes)
