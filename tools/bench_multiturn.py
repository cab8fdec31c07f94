"""What KV reuse across turns and tool/generation overlap save on multi-turn episodes.

Episodes of ``--turns`` model turns on the fast engine (hf_fast); every turn but the last gets a
tool reply of ``--reply-chars`` characters after ``--tool-s`` seconds. Each figure is the median
wall time of ``--iters`` runs after one warm-up:

* ``reuse``: kept sessions on vs off (full re-prefill of the whole conversation every turn),
  with the prompt tokens the engine prefilled; greedy episodes must be identical;
* ``lanes``: ``--lanes`` lanes vs 1 (all episodes generate, then all tools run).

    python tools/bench_multiturn.py                                   # tiny random model, CPU
    python tools/bench_multiturn.py --model models/smol --device cuda --episodes 64 --turns 6
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from streamrl.config import ModelConfig
from streamrl.engines.hf_fast import FastHFEngine
from streamrl.engines.hf_fast_config import FastHFConfig
from streamrl.envs.base import FunctionEnv, StepResult
from streamrl.envs.episode import EpisodeLimits, episode_metrics, run_episodes
from streamrl.envs.render import PlainTextRenderer


def _env(turns: int, tool_s: float, reply: str) -> FunctionEnv:
    def step(problem, seen):
        if len(seen) < turns:
            time.sleep(tool_s)
            return StepResult([{"role": "tool", "content": reply}], 0.0, False)
        return StepResult([], 1.0, True)
    return FunctionEnv(lambda p: [{"role": "user", "content": p}], step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="HF folder (default: the tiny random model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv", default="static", choices=["static", "paged"])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--reply-chars", type=int, default=24)
    ap.add_argument("--tool-s", type=float, default=0.3)
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if args.device != "cpu"
                                                     else torch.float32)
    else:
        from streamrl.models.factory import build_model

        model, tok = build_model(ModelConfig(max_positions=1024), seed=0)
    turns, reply = args.turns, ("=12345 " * args.reply_chars)[: args.reply_chars]
    # prompts are under 64 tokens; the driver keeps prompt + response + turn within the cache
    limits = EpisodeLimits(max_turns=turns, max_turn_tokens=args.turn_tokens, max_response_tokens=1024 - 64)
    eng = FastHFEngine(model.eval(), tok, FastHFConfig(device=args.device, batch_size=args.episodes, kv_cache=args.kv,
                                                       max_seq_len=1024, eos_token_id=-1))  # no EOS: every turn runs to its cap
    problems = [f"{i * 7919 % 1000}+{i}=" for i in range(args.episodes)]

    def run(tool_s: float, **kw):
        times, eps = [], None
        for it in range(args.iters + 1):
            envs = [_env(turns, tool_s, reply) for _ in problems]
            t0 = time.perf_counter()
            eps = run_episodes(eng, envs, problems, PlainTextRenderer(tok), tok.decode, tok.eos_token_id, limits,
                               temperature=0.0, **kw)
            if it:
                times.append(time.perf_counter() - t0)
        return statistics.median(times), eps

    out = {"config": vars(args)}
    (on_s, on), (off_s, off) = run(0.0), run(0.0, reuse_kv=False)
    if [e.response for e in on] != [e.response for e in off]:
        raise SystemExit("KV reuse changed the greedy episodes")
    m_on, m_off = episode_metrics(on), episode_metrics(off)
    out["reuse"] = {"wall_s_reuse": round(on_s, 3), "wall_s_full": round(off_s, 3), "speedup": round(off_s / on_s, 2),
                    "prefill_tokens_reuse": m_on["env/prefill_tokens"], "prefill_tokens_full": m_off["env/prefill_tokens"]}
    (one_s, one), (many_s, many) = run(args.tool_s, lanes=1), run(args.tool_s, lanes=args.lanes)
    if [e.response for e in one] != [e.response for e in many]:
        raise SystemExit("lanes changed the greedy episodes")
    out["lanes"] = {"tool_s": args.tool_s, "wall_s_1_lane": round(one_s, 3),
                    f"wall_s_{args.lanes}_lanes": round(many_s, 3), "ratio": round(many_s / one_s, 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
