"""Where a learner step of configs/gpu-reasoning.yaml goes (~11 s a step in the race on the H200).

Two in-process measurements of the recipe's shape, each timed with device syncs, then one JSON line:

* ``decode``: the rollout worker's engine (hf_fast, built by ``streamrl.engines.factory.fast_hf_config``
  from the config: one slot per sequence of a worker batch, prompts_per_batch x group_size) running one
  worker batch, EOS off and each sample's length set by a per-request cap drawn from the race's
  measured lengths (``--trunc-frac`` of the samples run to ``rollout.max_new_tokens``, the others
  ~``--median-len`` tokens). Cases: ``mix`` (those lengths: the batch lasts as long as its longest
  sample), ``no_tail`` (the same without the truncated samples). Reported per case: wall, decode
  steps, ms per decode step, generated tokens, slot occupancy (generated tokens / (slots x steps)).
* ``learner``: :class:`streamrl.learner.trainer.Trainer` on one step's samples (groups_per_step x
  group_size, the same lengths as the first groups of the worker batch): ``compute_s`` (the
  learner's own ``learner/compute_s``) split into ``optimizer_s`` (AdamW, synced around it) and
  ``forward_backward_s`` (the rest), micro-batch count and packed tokens vs the tokens of rows padded
  to the longest, and ``publish_gather_s`` (the full tensors a publish reads, cloned on the device:
  the ipc plane's copy) and ``publish_d2h_s`` (copied to the host: the shm plane's).

Both per ``--dtypes`` (``model.dtype``; at world size 1 the learner has no mixed precision, so
``float32`` trains in fp32 and ``bfloat16`` in pure bf16). Summary ``per_step_estimate_s`` per dtype:
the rollout-bound step = mix wall x groups_per_step / prompts_per_batch (one worker; the learner
waits for it), next to the learner's compute.

GPU (next session; tools/gpu/reasoning_profile.sh runs this and the loop's own breakdown):
    python3 tools/gpu/reasoning_profile.py --model /tmp/smol --device cuda --json
CPU dry run of the same code on a tiny SmolLM2-shaped folder (tests/test_gpu_reasoning_profile.py):
    python tools/gpu/reasoning_profile.py --tiny --device cpu --json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SHAPE = REPO / "tools" / "gpu" / "smol_shape"  # SmolLM2-135M's config and tokenizer
# --tiny: the CPU dry run's shape (same code paths, small numbers)
TINY_OVERRIDES = ["rollout.prompts_per_batch=4", "rollout.group_size=4", "rollout.max_new_tokens=48",
                  "rollout.max_model_len=96", "learner.groups_per_step=2", "learner.max_tokens_per_microbatch=512",
                  "learner.logprob_chunk_tokens=256"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "gpu-reasoning.yaml"))
    p.add_argument("--model", default="/tmp/smol", help="HF folder (tools/gpu/smol_shape/make.py makes a random one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--parts", default="learner,decode")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prompt tokens, chat template included (default 100; 24 with --tiny)")
    p.add_argument("--median-len", type=int, default=None,
                   help="median response tokens of the finished samples (default 72, the race's; 6 with --tiny)")
    p.add_argument("--trunc-frac", type=float, default=0.085, help="share of samples cut at max_new_tokens")
    p.add_argument("--steps", type=int, default=2, help="timed learner steps")
    p.add_argument("--tiny", action="store_true", help="a tiny SmolLM2-shaped model and batch (CPU dry run)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--loop-metrics", default=None, metavar="METRICS_JSONL",
                   help="instead: the per-step breakdown of a run's metrics.jsonl (see loop_breakdown)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. rollout.prompts_per_batch=32")
    return p.parse_args(argv)


def response_lengths(n: int, cap: int, median: int, trunc_frac: float, seed: int = 0) -> list[int]:
    """``n`` response lengths: ``round(trunc_frac * n)`` at ``cap`` (at least one when trunc_frac > 0),
    the others log-normal around ``median`` (sigma 0.5), within [2, cap - 1]; shuffled by ``seed``."""
    rng = random.Random(seed)
    n_trunc = max(1, round(trunc_frac * n)) if trunc_frac > 0 else 0
    short = [min(cap - 1, max(2, round(median * math.exp(rng.gauss(0.0, 0.5))))) for _ in range(n - n_trunc)]
    out = [cap] * n_trunc + short
    rng.shuffle(out)
    return out


def tiny_folder(dest: Path) -> Path:
    """SmolLM2's config shrunk (2 layers, hidden 64) with its tokenizer; random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    cfg = AutoConfig.from_pretrained(SHAPE)
    cfg.update({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(dest)
    AutoTokenizer.from_pretrained(SHAPE).save_pretrained(dest)
    return dest


def load_cfg(args, dtype: str):
    from streamrl.config import load_config  # noqa: PLC0415

    return load_config(args.config, [*(TINY_OVERRIDES if args.tiny else []), f"model.path={args.model}",
                                     f"model.dtype={dtype}", f"rollout.device={args.device}",
                                     f"learner.device={args.device}", f"eval.device={args.device}",
                                     "learner.skip_no_signal=false", *args.overrides])


def prompts_for(cfg, vocab: int, prompt_len: int) -> list[list[int]]:
    """prompts_per_batch distinct random prompts, each repeated group_size times (a worker batch)."""
    g = torch.Generator().manual_seed(0)
    rc = cfg.rollout
    distinct = [torch.randint(10, vocab - 1, (prompt_len,), generator=g).tolist() for _ in range(rc.prompts_per_batch)]
    return [q for q in distinct for _ in range(rc.group_size)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_decode(args, cfg, lengths: list[int]) -> dict:
    from streamrl.engines.factory import fast_hf_config  # noqa: PLC0415
    from streamrl.engines.hf_fast import FastHFEngine  # noqa: PLC0415
    from streamrl.models.factory import load_model_and_tokenizer  # noqa: PLC0415

    rc = cfg.rollout
    model, tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
    # EOS off: every sample runs to its cap, so the lengths are the ones asked for
    eng = FastHFEngine(model, tok, dataclasses.replace(fast_hf_config(cfg, model), eos_token_id=-1))
    prompts = prompts_for(cfg, len(tok), args.prompt_len)
    t0 = time.perf_counter()
    eng.generate(prompts, rc.max_new_tokens, rc.temperature, max_tokens=[min(16, rc.max_new_tokens)] * len(prompts))
    sync(args.device)
    out = {"slots": eng.batch, "warmup_s": time.perf_counter() - t0, "decode_attention": eng.decode_attention,
           "cuda_graphs": eng.graphs_on}
    short = min(args.median_len, rc.max_new_tokens - 1)
    cases = {"mix": lengths, "no_tail": [x if x < rc.max_new_tokens else short for x in lengths]}
    for name, caps in cases.items():
        steps0, prefill0 = eng.decode_steps, eng.prefill_tokens
        sync(args.device)
        t0 = time.perf_counter()
        gen = eng.generate(prompts, rc.max_new_tokens, rc.temperature, max_tokens=caps)
        sync(args.device)
        wall = time.perf_counter() - t0
        steps = eng.decode_steps - steps0
        tokens = sum(len(t) for t in gen.tokens)
        out[name] = {"wall_s": wall, "decode_steps": steps, "ms_per_decode_step": 1e3 * wall / max(steps, 1),
                     "generated_tokens": tokens, "longest": max(caps), "tokens_per_s": tokens / wall,
                     "slot_occupancy": tokens / max(eng.batch * steps, 1),
                     "prefill_tokens": eng.prefill_tokens - prefill0}
    out["compiled"] = eng.compiled  # False after a failed compilation (the engine warns and decodes plainly)
    out["graphs_captured"] = eng.captures
    eng.close()
    del model
    return out


def measure_learner(args, cfg, lengths: list[int]) -> dict:
    from streamrl.learner.trainer import Trainer  # noqa: PLC0415
    from streamrl.trajectory import pack_trajectories  # noqa: PLC0415

    lc, rc = cfg.learner, cfg.rollout
    n = lc.groups_per_step * rc.group_size
    tr = Trainer(cfg)
    prompts = prompts_for(cfg, tr.vocab_size, args.prompt_len)[:n]
    g = torch.Generator().manual_seed(1)
    resp = [torch.randint(10, tr.vocab_size - 1, (k,), generator=g).tolist() for k in lengths[:n]]
    lps = [(-torch.rand(len(r), generator=g) * 3).tolist() for r in resp]
    batch = pack_trajectories(prompts, resp, lps, [[0] * len(r) for r in resp], torch.rand(n, generator=g).tolist(),
                              [i // rc.group_size for i in range(n)], list(range(n)), 0, 0.0)
    micro, _ = tr._microbatches(batch, list(range(n)))  # what one step packs (the learner's own packing)
    packed_tokens = sum(int(m.input_ids.numel()) for m in micro)
    opt_s = []
    step_fn = tr.optim.step

    def timed_step(*a, **k):  # the optimizer alone, device work included
        sync(args.device)
        t = time.perf_counter()
        r = step_fn(*a, **k)
        sync(args.device)
        opt_s.append(time.perf_counter() - t)
        return r

    tr.optim.step = timed_step
    t0 = time.perf_counter()
    tr.warm_up()
    tr.step(batch)  # first step: allocations, optimizer state
    sync(args.device)
    first_s = time.perf_counter() - t0
    opt_s.clear()
    comp = []
    for _ in range(args.steps):
        sync(args.device)
        t = time.perf_counter()
        m = tr.step(batch)
        sync(args.device)
        comp.append(time.perf_counter() - t)
        if m.get("learner/skipped_no_signal"):
            raise RuntimeError("the timed step was skipped (no signal)")
    compute = statistics.median(comp)
    optimizer = statistics.median(opt_s) * len(opt_s) / len(comp)
    t = time.perf_counter()
    full = [x.clone() for x in tr.full_tensors()]
    sync(args.device)
    gather = time.perf_counter() - t
    t = time.perf_counter()
    host = [x.to("cpu") for x in full]
    sync(args.device)
    d2h = time.perf_counter() - t
    prompt_tokens = lc.groups_per_step * args.prompt_len if lc.shared_prompt else n * args.prompt_len
    out = {"samples": n, "response_tokens": sum(lengths[:n]), "prompt_tokens_shared": prompt_tokens,
           "microbatches": len(micro), "packed_tokens": packed_tokens,
           "padded_tokens": n * (args.prompt_len + max(lengths[:n])), "warmup_and_first_step_s": first_s,
           "compute_s": compute, "optimizer_s": optimizer, "forward_backward_s": compute - optimizer,
           "publish_gather_s": gather, "publish_d2h_s": d2h, "publish_bytes": sum(x.numel() * x.element_size()
                                                                                 for x in host)}
    del tr, full, host
    return out


def loop_breakdown(rows: list[dict]) -> dict:
    """Medians over a run's steps (the first one, with the warm-up, left out when there are more) of where
    the wall between two learner steps went: ``idle_s`` (``learner/idle_s``: waiting for a complete batch),
    ``compute_s`` (``learner/compute_s``: forward, backward, optimizer), ``publish_s``
    (``weights/publish_s``), ``step_rest_s`` (the rest of ``learner/step_s``: bookkeeping of the step) and
    ``other_s`` (wall gap minus idle minus step: reporting, HF exports and checkpoints, which no other
    figure counts)."""
    warmup = rows[0].get("learner/warmup_s") if rows else None
    rows = rows[1:] if len(rows) > 2 else rows

    def med(xs):
        return statistics.median(xs) if xs else None
    gaps = [b["wall_s"] - a["wall_s"] for a, b in zip(rows, rows[1:])]
    per = rows[1:] if gaps else rows
    out = {"steps": len(per), "wall_per_step_s": med(gaps),
           "idle_s": med([r.get("learner/idle_s", 0.0) for r in per]),
           "step_s": med([r.get("learner/step_s", 0.0) for r in per]),
           "compute_s": med([r.get("learner/compute_s", 0.0) for r in per]),
           "publish_s": med([r.get("weights/publish_s", 0.0) for r in per])}
    out["step_rest_s"] = out["step_s"] - out["compute_s"] - out["publish_s"]
    out["other_s"] = (med([g - r.get("learner/idle_s", 0.0) - r.get("learner/step_s", 0.0) for g, r in zip(gaps, per)])
                      if gaps else None)
    out["idle_frac"] = sum(r.get("learner/idle_s", 0.0) for r in per) / max(
        sum(r.get("learner/idle_s", 0.0) + r.get("learner/step_s", 0.0) for r in per), 1e-9)
    out["response_len_mean"] = med([r["learner/response_len_mean"] for r in per if "learner/response_len_mean" in r])
    out["first_step_warmup_s"] = warmup
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.loop_metrics:
        rows = [json.loads(line) for line in Path(args.loop_metrics).read_text().splitlines() if line.strip()]
        if not rows:
            print("loop: no learner step in", args.loop_metrics)
            return 1
        out = loop_breakdown(rows)
        print("loop breakdown (medians per learner step, s):", json.dumps(
            {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}))
        return 0
    torch.set_num_threads(max(1, torch.get_num_threads()))
    parts = set(args.parts.split(","))
    result = {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            args.model = str(tiny_folder(Path(tmp) / "tiny"))
        if args.prompt_len is None:
            args.prompt_len = 24 if args.tiny else 100
        if args.median_len is None:
            args.median_len = 6 if args.tiny else 72
        for dtype in args.dtypes.split(","):
            cfg = load_cfg(args, dtype)
            rc, lc = cfg.rollout, cfg.learner
            lengths = response_lengths(rc.prompts_per_batch * rc.group_size, rc.max_new_tokens, args.median_len,
                                       args.trunc_frac)
            res: dict = {"lengths_mean": statistics.mean(lengths), "lengths_median": statistics.median(lengths),
                         "truncated": sum(x >= rc.max_new_tokens for x in lengths)}
            if "learner" in parts:
                res["learner"] = measure_learner(args, cfg, lengths)
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
            if "decode" in parts:
                res["decode"] = measure_decode(args, cfg, lengths)
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
            steps_per_batch = rc.prompts_per_batch / lc.groups_per_step
            est = {}
            if "decode" in res:
                est["rollout_bound_step_s"] = res["decode"]["mix"]["wall_s"] / steps_per_batch
                est["rollout_bound_step_s_no_tail"] = res["decode"]["no_tail"]["wall_s"] / steps_per_batch
            if "learner" in res:
                est["learner_compute_s"] = res["learner"]["compute_s"]
            res["per_step_estimate_s"] = est
            result[dtype] = res
            if not args.json:
                print(dtype, json.dumps(res, indent=1))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
