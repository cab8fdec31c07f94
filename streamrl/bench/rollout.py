"""``streamrl-bench rollout``: the worker loop's tokens/s against the bare engine, same run.

For each (engine, model) pair the same pre-drawn prompt batches go through

* **bare**: ``engine.generate(prompts, ...)`` only, and
* **loop**: :class:`streamrl.rollout.batch.BatchRoller` (prompt encoding, generate,
  decoding, rewards, packing) plus a real ZeroMQ send to a local receiver thread,

alternating bare/loop batch by batch (and which goes first) so machine-load drift and
prefix-cache hits favour neither. ``ratio_vs_bare_engine`` = median per-batch tokens/s of
the loop / that of the bare engine (the target is >= 0.9); ``ratio_of_totals`` uses sums.
``--eval N`` adds greedy exact-answer accuracy on N held-out arithmetic problems.

``--streaming`` (hf_fast) adds batch vs stream on the same requests with long-tailed lengths
(per-request caps: 15 % run to ``max_new_tokens``, the rest log-normal around 15 % of it, EOS
off, like the long-tailed reasoning answers of the GPU recipe): ``generate`` batch after batch,
each as long as its longest sample, against one ``generate_stream`` that refills whole groups as
slots free (:func:`bench_streaming`); ``ratio_stream_vs_batch`` of tokens/s, decode steps of each.

With ``--engines hf_fast`` the row also compares shared-prompt groups (each prompt prefilled
once, its K/V forked for the group) with plain ``model.generate()`` on the same prompts and
lengths (:func:`streamrl.bench.hf_fast.bench_groups`): ``ratio_vs_plain_generate`` and
``greedy_tokens_equal``.

Examples:
    streamrl-bench rollout --json
    streamrl-bench rollout --engines hf_fast --max-new-tokens 256 --group-size 8 --json
    streamrl-bench rollout --engines vllm --models smol-moe --smol-path models/smol-moe --eval 100
    streamrl-bench rollout --engines hf_fast --streaming --max-new-tokens 128 --json
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time

import torch

from streamrl.bench.hf_fast import bench_fast_vs_generate, bench_groups
from streamrl.config import Config, load_config
from streamrl.engines.factory import build_engine
from streamrl.models.factory import load_model_and_tokenizer
from streamrl.rewards import exact_answer, response_texts
from streamrl.rollout.batch import BatchRoller
from streamrl.rollout.factory import run_reward
from streamrl.tasks import build_task
from streamrl.tasks.registry import Problem, eval_problems, problem_stream
from streamrl.transport.receiver import TrajectoryReceiver
from streamrl.transport.sender import TrajectorySender

MODELS = ("tiny", "smol-moe")
ENGINES = ("hf", "hf_fast", "vllm")


def model_overrides(model: str, smol_path: str) -> list[str]:
    if model == "tiny":
        return ["task.name=copy_digits", "rollout.max_new_tokens=6"]
    if not os.path.isdir(smol_path):
        raise ValueError(f"--smol-path = {smol_path!r} is not a folder; run streamrl-prepare-model first")
    return [f"model.path={smol_path}", "task.name=arithmetic", "task.num_digits=2", "rollout.chat_template=true",
            "rollout.rewards=exact_answer=1.0,format=0.1", "rollout.max_new_tokens=8"]


class _Drain:
    """A real ZeroMQ receiver on a thread, so the loop pays the actual send path."""

    def __init__(self):
        self.rx = TrajectoryReceiver("tcp://127.0.0.1:*", hwm=64)
        self.endpoint = self.rx.endpoint
        self.received = 0
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop:
            self.received += len(self.rx.poll(0.05))

    def close(self):
        self._stop = True
        self._t.join(timeout=5)
        self.rx.close()


def greedy_accuracy(engine, roller, problems: list[Problem], max_new_tokens: int) -> float:
    """Exact-answer accuracy of greedy decoding over ``problems``."""
    prompts = [roller.encode(p.prompt) for p in problems]
    if engine.name == "vllm":
        tokens = engine.generate(prompts, max_new_tokens, temperature=0.0).tokens
    else:
        tokens = []
        with torch.no_grad():
            for p in prompts:
                out = engine.model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens,
                                            pad_token_id=engine.pad_id, eos_token_id=engine.eos_id)
                tokens.append(out[0, len(p):].tolist())
    texts = response_texts(roller.tok, tokens)
    return sum(exact_answer(p, t) for p, t in zip(problems, texts)) / max(len(problems), 1)


def long_tail_caps(n: int, max_new: int, seed: int = 0) -> list[int]:
    """``n`` response caps shaped like long-tailed reasoning lengths: 15 % at ``max_new``, the rest
    log-normal with a median of 15 % of it."""
    rng = random.Random(seed)
    return [max_new if rng.random() < 0.15 else
            max(1, min(max_new, round(0.15 * max_new * math.exp(rng.gauss(0.0, 0.6))))) for _ in range(n)]


def bench_streaming(engine, prompts: list[list[int]], group_size: int, max_new: int, temperature: float,
                    repeats: int) -> dict:
    """Batch vs stream (hf_fast) on the same ``prompts`` (``group_size`` copies of each in a row) with
    :func:`long_tail_caps`: ``generate`` on ``engine.batch`` requests at a time, against one
    ``generate_stream`` fed whole groups as their slots free. Alternated ``repeats`` times (order
    swapped each time); the medians of tokens/s. EOS is switched off so the caps set the lengths
    (``same_tokens``); a compiled CUDA engine keeps the EOS id it captured, so there some responses
    may end early and ``same_tokens`` is false."""
    caps = long_tail_caps(len(prompts), max_new)
    b = engine.batch

    def batch() -> tuple[int, float, int]:
        t, s0, n = time.perf_counter(), engine.decode_steps, 0
        for i in range(0, len(prompts), b):
            n += sum(len(x) for x in engine.generate(prompts[i: i + b], max_new, temperature,
                                                     max_tokens=caps[i: i + b]).tokens)
        return n, time.perf_counter() - t, engine.decode_steps - s0

    def stream() -> tuple[int, float, int]:
        t, s0, nxt, got = time.perf_counter(), engine.decode_steps, [0], [0]

        def refill(free: int) -> list[list[int]] | None:
            if nxt[0] >= len(prompts):
                return None
            take = min(free // group_size * group_size, len(prompts) - nxt[0])
            nxt[0] += take
            return prompts[nxt[0] - take: nxt[0]]

        def on_finished(j, tokens, *_):
            got[0] += len(tokens)

        engine.generate_stream(refill, on_finished, max_new, temperature, max_tokens=caps.__getitem__)
        return got[0], time.perf_counter() - t, engine.decode_steps - s0

    eos, engine.eos_id = engine.eos_id, -1  # the caps alone set the lengths
    runs: dict[str, list] = {"batch": [], "stream": []}
    try:
        for r in range(repeats):
            for name, fn in ((("batch", batch), ("stream", stream)) if r % 2 == 0 else
                             (("stream", stream), ("batch", batch))):
                runs[name].append(fn())
    finally:
        engine.eos_id = eos
    tps = {k: statistics.median(n / max(t, 1e-9) for n, t, _ in v) for k, v in runs.items()}
    return {"requests": len(prompts), "slots": b, "max_new_tokens": max_new,
            "tokens": runs["batch"][0][0], "mean_cap": round(sum(caps) / len(caps), 1),
            "same_tokens": all(n == sum(caps) for v in runs.values() for n, _, _ in v),  # the caps set every length
            "batch_tokens_per_s": round(tps["batch"], 1), "stream_tokens_per_s": round(tps["stream"], 1),
            "ratio_stream_vs_batch": round(tps["stream"] / max(tps["batch"], 1e-9), 3),
            "batch_decode_steps": runs["batch"][0][2], "stream_decode_steps": runs["stream"][0][2],
            "batch_slot_occupancy": round(runs["batch"][0][0] / max(runs["batch"][0][2] * b, 1), 3),
            "stream_slot_occupancy": round(runs["stream"][0][0] / max(runs["stream"][0][2] * b, 1), 3)}


def pair_config(engine_name: str, model: str, args) -> Config:
    """The run config of one (engine, model) pair: the model preset, then the CLI's lengths and overrides."""
    length = []
    if args.max_new_tokens:  # after the model preset, which sets its own short default
        length = [f"rollout.max_new_tokens={args.max_new_tokens}",
                  f"rollout.max_model_len={max(512, args.max_new_tokens + 256)}"]
    return load_config(args.config, [f"rollout.engine={engine_name}", f"rollout.group_size={args.group_size}",
                                     f"rollout.prompts_per_batch={args.prompts_per_batch}",
                                     *model_overrides(model, args.smol_path), *length, *args.overrides])


def alternate_paths(engine, roller: BatchRoller, feed: list[Problem], sender: TrajectorySender,
                    batches: list[list[Problem]], cfg: Config) -> tuple[list, list]:
    """``(bare_runs, loop_runs)``: ``(tokens, seconds)`` of each measured batch on either path;
    batch 0 warms both paths up. ``roller`` draws its problems from ``feed``."""
    rc = cfg.rollout
    bare_runs, loop_runs = [], []
    for i, batch in enumerate(batches):
        prompts = [roller.encode(p.prompt) for p in batch for _ in range(rc.group_size)]

        def bare():
            t = time.perf_counter()
            gen = engine.generate(prompts, rc.max_new_tokens, rc.temperature)
            return sum(len(x) for x in gen.tokens), time.perf_counter() - t

        def loop():
            feed.extend(batch)
            t = time.perf_counter()
            td = roller.rollout_batch(version=0)
            while not sender.send(td, timeout_s=1.0):
                pass
            return int(td["response_lens"].sum()), time.perf_counter() - t

        # alternate the order: whoever runs second may find the prompts in the prefix cache
        first, second = (bare, loop) if i % 2 == 0 else (loop, bare)
        r1, r2 = first(), second()
        if i == 0:
            continue
        b, lp = (r1, r2) if first is bare else (r2, r1)
        bare_runs.append(b)
        loop_runs.append(lp)
    return bare_runs, loop_runs


def pair_row(engine_name: str, model: str, cfg: Config, start_s: float, bare_runs: list, loop_runs: list,
             batches: int) -> dict:
    """The result row of one pair from its ``(tokens, seconds)`` runs."""
    rc = cfg.rollout
    # medians of per-batch tokens/s: robust to other processes stealing the 2 cores
    bare_tps = statistics.median(n / max(t, 1e-9) for n, t in bare_runs)
    loop_tps = statistics.median(n / max(t, 1e-9) for n, t in loop_runs)
    sum_ratio = (sum(n for n, _ in loop_runs) / sum(t for _, t in loop_runs)) / \
        (sum(n for n, _ in bare_runs) / sum(t for _, t in bare_runs))
    return {"engine": engine_name, "model": model, "engine_start_s": round(start_s, 1),
            "bare_tokens_per_s": round(bare_tps, 1), "loop_tokens_per_s": round(loop_tps, 1),
            "ratio_vs_bare_engine": round(loop_tps / max(bare_tps, 1e-9), 3),
            "ratio_of_totals": round(sum_ratio, 3),
            "bare_tokens": sum(n for n, _ in bare_runs), "loop_tokens": sum(n for n, _ in loop_runs),
            "batches": batches, "sequences_per_batch": rc.prompts_per_batch * rc.group_size}


def bench_pair(engine_name: str, model: str, args) -> dict:
    """One (engine, model) row: bare engine vs worker loop, plus the hf_fast group comparison and
    greedy accuracy when asked."""
    cfg = pair_config(engine_name, model, args)
    rc = cfg.rollout
    t0 = time.perf_counter()
    mdl, tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
    engine = build_engine(cfg, mdl, tok)
    start_s = time.perf_counter() - t0
    task = build_task(cfg.task)  # every task.* field (long_sequence lengths too)
    batches = [list(itertools.islice(problem_stream(task, 1, b, args.batches + 1), rc.prompts_per_batch))
               for b in range(args.batches + 1)]
    feed: list[Problem] = []
    roller = BatchRoller(cfg, engine, tok, iter(lambda: feed.pop(0), None), run_reward(cfg), worker_id=0)
    drain = _Drain()
    sender = TrajectorySender(drain.endpoint, 0, hwm=64)
    groups = acc = stream = None
    try:
        bare_runs, loop_runs = alternate_paths(engine, roller, feed, sender, batches, cfg)
        if engine_name == "hf_fast" and args.streaming:  # long-tailed lengths: batch path vs stream
            stream = bench_streaming(engine, [p for batch in batches[1:] for p in roller.scorer.prompts(batch)],
                                     rc.group_size, rc.max_new_tokens, rc.temperature, args.group_repeats)
        if engine_name == "hf_fast":  # shared-prompt groups vs plain model.generate() on the same prompts
            groups = bench_groups(engine, [roller.encode(p.prompt) for p in batches[1]], rc.group_size,
                                  rc.max_new_tokens, repeats=args.group_repeats)
        if args.eval and model == "smol-moe":
            acc = greedy_accuracy(engine, roller, eval_problems(task, cfg.run.seed, args.eval), rc.max_new_tokens)
    finally:
        sender.close()
        drain.close()
        engine.close()
    row = pair_row(engine_name, model, cfg, start_s, bare_runs, loop_runs, args.batches)
    if groups is not None:
        row["groups_vs_plain_generate"] = groups
        row["ratio_vs_plain_generate"] = groups["ratio_vs_plain_generate"]
        row["greedy_tokens_equal"] = groups["greedy_tokens_equal"]
    if stream is not None:
        row["streaming"] = stream
        row["ratio_stream_vs_batch"] = stream["ratio_stream_vs_batch"]
    if acc is not None:
        row["greedy_accuracy"] = round(acc, 4)
        row["eval_problems"] = args.eval
    return row


def _in_subprocess(engine: str, model: str, argv) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = [a for i, a in enumerate(argv) if a not in ("--engines", "--models", "--json")
            and (i == 0 or argv[i - 1] not in ("--engines", "--models"))]
    cmd = [sys.executable, "-m", "streamrl.bench.rollout", "--json", "--engines", engine, "--models", model, *rest]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["rows"][0]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="streamrl-bench rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="last line: one JSON object")
    p.add_argument("--engines", default="hf,vllm", help=f"comma list of {ENGINES}")
    p.add_argument("--engine", default=None, help="one engine (same as --engines ENGINE)")
    p.add_argument("--fast-preset", default="tiny",
                   help="with the hf engine: also time FastHFEngine vs model.generate() on this preset "
                        "(streamrl.bench.hf_fast: tiny | moe-1b); 'none' skips it")
    p.add_argument("--device", default="cpu", help="device of the FastHFEngine comparison")
    p.add_argument("--models", default="tiny", help=f"comma list of {MODELS}")
    p.add_argument("--smol-path", default="models/smol-moe", help="prepared SmolLM2-MoE folder")
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--batches", type=int, default=8, help="measured batches per path (after 1 warm-up)")
    p.add_argument("--prompts-per-batch", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="response length (overrides rollout.max_new_tokens; EOS is off in the hf_fast group comparison)")
    p.add_argument("--group-repeats", type=int, default=3, help="hf_fast: timed runs of each path in the group comparison")
    p.add_argument("--streaming", action="store_true",
                   help="hf_fast: also batch vs stream on long-tailed per-request caps (ratio_stream_vs_batch)")
    p.add_argument("--eval", type=int, default=0, help="greedy accuracy on this many held-out problems (smol-moe)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    if args.engine:
        args.engines = args.engine
    engines = [e for e in args.engines.split(",") if e]
    models = [m for m in args.models.split(",") if m]
    for e in engines:
        if e not in ENGINES:
            p.error(f"--engines: {e!r} is not one of {ENGINES}")
    for m in models:
        if m not in MODELS:
            p.error(f"--models: {m!r} is not one of {MODELS}")
    if args.batches < 1:
        p.error(f"--batches = {args.batches}: must be >= 1")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        p.error(f"--max-new-tokens = {args.max_new_tokens}: must be >= 1")
    if args.group_repeats < 1:
        p.error(f"--group-repeats = {args.group_repeats}: must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    models = [m for m in args.models.split(",") if m]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    pairs = [(e, m) for m in models for e in engines]
    rows = []
    for e, m in pairs:
        # one process per pair when there are several: vLLM keeps process-global state, and a
        # fresh process gives each pair the same starting conditions
        row = bench_pair(e, m, args) if len(pairs) == 1 else _in_subprocess(e, m, argv)
        rows.append(row)
        if not args.json:
            print(json.dumps(row))
    result = {"rows": rows, "ratio_vs_bare_engine": min(r["ratio_vs_bare_engine"] for r in rows)}
    for r in rows:
        result[f"ratio_vs_bare_engine/{r['engine']}/{r['model']}"] = r["ratio_vs_bare_engine"]
        if "ratio_vs_plain_generate" in r:  # hf_fast: shared-prompt groups vs plain generate()
            result["ratio_vs_plain_generate"] = r["ratio_vs_plain_generate"]
            result["greedy_tokens_equal"] = r["greedy_tokens_equal"]
        if "ratio_stream_vs_batch" in r:
            result["ratio_stream_vs_batch"] = r["ratio_stream_vs_batch"]
    if "hf" in engines and args.fast_preset != "none":
        # The hf engine's fast path (static KV cache, refill, CUDA graphs on GPU) against plain
        # model.generate() on the same model, prompts and lengths, in this same run.
        fast = bench_fast_vs_generate(preset=args.fast_preset, device=args.device)
        result["hf_fast"] = fast
        result["ratio_vs_plain_generate"] = fast["ratio_vs_plain_generate"]
        if not args.json:
            print(json.dumps(fast))
    print(json.dumps(result) if args.json else f"min ratio_vs_bare_engine: {result['ratio_vs_bare_engine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
