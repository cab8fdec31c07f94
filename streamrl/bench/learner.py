"""``streamrl-bench learner``: the learner step, padded (before) vs packed vs shared-prompt.

Same model, same batch, side by side; each implementation runs in its own subprocess so its
peak resident memory (``ru_maxrss``) is its own:

* ``padded``: the reference step (:mod:`streamrl.bench.padded_reference`): rows padded to
  the longest, ``log_softmax`` in fp32 over ``[B, T, V]`` at every position;
* ``packed``: token-budget micro-batches of packed sequences, log-probs only at response
  positions in chunks (:meth:`Trainer.step`);
* ``shared``: ``packed`` with ``learner.shared_prompt`` (the learner's default): a group's
  prompt runs once.

By default ``padded`` and ``shared`` run (``--impl all`` adds ``packed``); the headline
``speedup_vs_padded`` / ``peak_mem_ratio_vs_padded`` / diffs are the ``shared`` step's, the
learner's default, and ``packed_*`` the plain packed step's.

Default shape (the CPU case): SmolLM2-135M dense (``models/smol``), 8 groups x 8
samples, chat-template arithmetic prompts, responses of 24 tokens, fp32, 2 threads. The
responses are fixed pseudo-random tokens (the step's cost does not depend on what they say).

Reported per implementation: ``step_s`` (mean over ``--steps`` timed steps after one warm-up
gradient pass), ``tokens_per_s`` (prompt + response tokens of the batch per second),
``peak_rss_GiB``; against ``padded``: ``speedup_vs_padded``, ``peak_mem_ratio_vs_padded``,
``max_abs_logprob_diff`` (response-token log-probs before the step) and ``max_abs_grad_diff``
(every parameter's gradient of the first pass). With ``--json`` the last line is one JSON object.
Every step trains every sample: ``learner.drop_zero_advantage`` is off (``"drop_zero_advantage":
false`` in the JSON, ``dropped_zero_adv_frac`` 0 per step), so the padded and packed steps
run the same samples whatever the batch's advantages.

``--attention`` picks ``learner.attention`` (auto: FlexAttention block masks on CUDA,
attention by segments on CPU); ``--profile N`` profiles N more steps with torch.profiler and writes its whole
kernel table by self device time to ``--profile-out`` (kernel families, the top 25 kernels and
the top 25 of the family "other" also go into the JSON).

``--synthetic-moe`` (the GPU case, ``tools/gpu/learner_long.sh``): the 1.31 B Qwen3-MoE of
:mod:`streamrl.bench.learner_step` (same shapes, random weights), saved once as an HF folder
into ``--model`` when that folder does not exist yet, random prompts of ``--prompt-len`` tokens, and achieved
TFLOP/s (the same FLOP count as ``learner_step``) next to the tokens/s.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from streamrl.bench import learner_step
from streamrl.bench.learner_step import profile_breakdown
from streamrl.bench.padded_reference import packed_gradients, padded_forward, padded_step
from streamrl.config import load_config
from streamrl.learner.attention import parse_flex_options, set_flex_kernel_options
from streamrl.learner.logprobs import token_logprobs
from streamrl.learner.packing import response_grid
from streamrl.learner.trainer import Trainer
from streamrl.models.tokenizer import build_char_tokenizer
from streamrl.tasks.arithmetic import Arithmetic
from streamrl.rollout.prompts import PromptEncoder
from streamrl.trajectory import pack_trajectories, to_padded

IMPLS = ("padded", "packed", "shared")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="streamrl-bench learner", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/smol", help="HF model folder")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--response-len", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=1, help="timed steps per implementation")
    # 4 groups (4 x ~245 tokens) per micro-batch: fewer, larger ops than 512 (0.6-0.7x the wall of a
    # 2-thread 8 x 8 step under load); the activations of 2048 would push the peak memory up
    p.add_argument("--budget", type=int, default=1024, help="learner.max_tokens_per_microbatch")
    p.add_argument("--impl", default="padded,shared", help="all, or a comma list of " + ", ".join(IMPLS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true", help="learner.compile: torch.compile each decoder layer")
    p.add_argument("--synthetic-moe", action="store_true", help="the learner_step 1.31 B MoE instead of --model")
    p.add_argument("--prompt-len", type=int, default=0, help="random prompts of this length (0: chat arithmetic)")
    p.add_argument("--peak", type=float, default=790.0, help="bf16 peak TFLOP/s per device for mfu")
    p.add_argument("--attention", default="auto", choices=("auto", "sdpa", "flex", "segments"), help="learner.attention")
    p.add_argument("--flex-options", default="",
                   help="FlexAttention kernel_options to sweep, e.g. fwd_BLOCK_M=64,fwd_BLOCK_N=128,bwd_BLOCK_M1=64 "
                        "(names: streamrl.learner.attention.FLEX_OPTION_NAMES; empty: torch's choice)")
    p.add_argument("--logprob-chunk", type=int, default=0,
                   help="learner.logprob_chunk_tokens (rows per LM-head chunk); 0 keeps the config's")
    p.add_argument("--profile", type=int, default=0,
                   help="after the timed steps, profile this many steps: the kernel table into --profile-out, "
                        "kernel families and top kernels into the JSON")
    p.add_argument("--profile-out", default="learner_profile.txt", help="the profiler table of --profile")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--workdir", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_config(args, impl: str):
    repo = Path(__file__).resolve().parents[2]
    return load_config(str(repo / "configs" / "tiny.yaml"), [
        f"model.path={args.model}", f"model.dtype={args.dtype}", f"learner.device={args.device}",
        f"learner.activation_checkpointing={'true' if args.activation_checkpointing else 'false'}",
        f"rollout.max_new_tokens={args.response_len}", "rollout.temperature=1.0", "learner.lr=1e-6",
        "learner.aux_loss_coef=0", f"learner.max_tokens_per_microbatch={args.budget}",
        # CPU: a micro-batch's response positions in one chunk, its logits kept for the backward
        # (on CUDA the long rows' [chunk, vocab] logits would not fit: the config's chunk)
        *([f"learner.logprob_chunk_tokens={args.budget}"] if args.device == "cpu" else []),
        f"learner.attention={args.attention}", f"learner.compile={'true' if args.compile else 'false'}",
        f"learner.shared_prompt={'true' if impl == 'shared' else 'false'}",
        # A bench batch of groups of one has no GRPO signal: the step must still run in full.
        "learner.skip_no_signal=false",
        # ... and the padded and packed steps must run the same samples: the padded reference
        # trains every sample, so the packed steps leave no zero-advantage sample out either
        # (with groups of one every advantage is 0 and the drop would leave nothing to time)
        "learner.drop_zero_advantage=false",
        *([f"learner.logprob_chunk_tokens={args.logprob_chunk}"] if args.logprob_chunk else []),
    ])


def make_batch(tok, args):
    """``groups x group_size`` trajectories: chat-template arithmetic prompts, fixed responses."""
    rng = random.Random(0)
    encode = PromptEncoder(tok, chat_template=True)
    task = Arithmetic(num_digits=2)
    g = torch.Generator().manual_seed(0)
    prompts, resp, lps = [], [], []
    for _ in range(args.groups):
        prompt = (encode(task.sample(rng).prompt) if not args.prompt_len else
                  torch.randint(3, len(tok) - 1, (args.prompt_len,), generator=g).tolist())
        for _ in range(args.group_size):
            prompts.append(prompt)
            resp.append(torch.randint(10, len(tok) - 1, (args.response_len,), generator=g).tolist())
            lps.append((-torch.rand(args.response_len, generator=g) * 3).tolist())
    n = len(prompts)
    return pack_trajectories(prompts, resp, lps, [[0] * args.response_len] * n, torch.rand(n, generator=g).tolist(),
                             [i // args.group_size for i in range(n)], list(range(n)), 0, 0.0)


def run_child(args) -> int:
    """One implementation: warm-up gradient pass (saved for comparison), log-probs, timed steps."""
    torch.set_num_threads(args.threads)
    set_flex_kernel_options(parse_flex_options(args.flex_options))  # before the first compiled forward
    impl, work = args.child, Path(args.workdir)
    if args.device.startswith("cuda"):
        torch.cuda.set_device(0)
    tr = Trainer(make_config(args, impl))
    batch = make_batch(tr.tokenizer, args)
    logp = _logprobs(tr, batch, impl)
    if impl == "padded":
        padded_step(tr, batch, optimizer_step=False)
    else:
        packed_gradients(tr, batch)
    diffs = _compare_with_padded(tr, logp, impl, work / "padded")
    tr.optim.zero_grad(set_to_none=True)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    step = (lambda: padded_step(tr, batch)) if impl == "padded" else (lambda: tr.step(batch))
    sync()
    t0 = time.perf_counter()
    m = {}
    for _ in range(args.steps):
        m = step()
        if m and m.get("learner/skipped_no_signal"):
            raise RuntimeError("the timed step was skipped (no signal): the figures would time nothing")
    sync()
    step_s = (time.perf_counter() - t0) / args.steps
    pad = to_padded(batch, tr.pad_id)
    res = {"impl": impl, "step_s": step_s, "tokens_per_s": float(pad["attention_mask"].sum()) / step_s,
           "trajectories": int(pad["input_ids"].shape[0]), "padded_shape": list(pad["input_ids"].shape),
           "trained_tokens": float(response_grid(batch, "response_mask").sum()),
           "peak_rss_GiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if impl != "padded":
        res.update(diffs)
        res["dropped_zero_adv_frac"] = m.get("learner/dropped_zero_adv_frac", 0.0)
    if args.device.startswith("cuda"):
        res["peak_cuda_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    if args.synthetic_moe:
        res.update(_flops(args, tr, float(pad["attention_mask"].sum()) / step_s))
    res.update({"attention": tr.attention, "drop_zero_advantage": tr.cfg.learner.drop_zero_advantage,
                "flex_options": args.flex_options, "logprob_chunk_tokens": tr.cfg.learner.logprob_chunk_tokens})
    res.update(_host_prepare_times(tr, batch, sync))
    if args.profile:
        out = Path(args.profile_out)
        out = str(out if impl == "packed" else out.with_name(f"{impl}_{out.name}"))
        res["profile"] = profile_breakdown(step, args.profile, tr.device, sync, table_path=out, top=25)
        res["profile_table"] = out
    (work / f"{impl}.json").write_text(json.dumps(res))
    return 0


def _compare_with_padded(tr, logp: torch.Tensor, impl: str, ref: Path) -> dict[str, float]:
    """The padded child writes its log-probs and gradients under ``ref``; the others compare
    theirs against them (max abs diffs). Tensor by tensor: no second copy of the gradients in
    this process's peak memory."""
    diffs = {"max_abs_logprob_diff": 0.0, "max_abs_grad_diff": 0.0, "max_abs_grad": 0.0}
    if impl == "padded":
        ref.mkdir(exist_ok=True)
        save_file({"t": logp.detach().cpu().contiguous()}, ref / "logprobs.safetensors")
    elif (ref / "logprobs.safetensors").exists():
        diffs["max_abs_logprob_diff"] = float((load_file(ref / "logprobs.safetensors")["t"] - logp.cpu()).abs().max())
    for i, (n, p) in enumerate(tr.model.named_parameters()):
        if p.grad is None:
            continue
        g = p.grad.detach().float().cpu()
        if impl == "padded":
            save_file({"t": g.contiguous()}, ref / f"{i}.safetensors")
        elif (ref / f"{i}.safetensors").exists():
            r = load_file(ref / f"{i}.safetensors")["t"]
            diffs["max_abs_grad_diff"] = max(diffs["max_abs_grad_diff"], float((r - g).abs().max()))
            diffs["max_abs_grad"] = max(diffs["max_abs_grad"], float(r.abs().max()))
        del g
    return diffs


def _host_prepare_times(tr, batch, sync) -> dict[str, float]:
    """The host part of the step (grid, advantages, packing, H2D copies, block masks):
    ``prepare_s`` all of it for the step's micro-batches, ``first_kernel_s`` what precedes its
    first kernel (the grid, the advantages and micro-batch 0; the trainer builds each later
    one while the device runs the one before): on the GPU that part is in the wall-vs-device gap."""
    sync()
    t1 = time.perf_counter()
    micro = tr._prepare(batch)[3][0][0]
    micro.prefetch(0)
    sync()
    first = time.perf_counter() - t1
    for i in range(1, len(micro)):
        micro.prefetch(i)
    sync()
    return {"first_kernel_s": first, "prepare_s": time.perf_counter() - t1, "microbatches_per_step": len(micro)}


def _moe_args(args):
    """The 1.31 B MoE shape of :mod:`streamrl.bench.learner_step` (its defaults)."""
    return learner_step.parse_args(["--seq", str(args.prompt_len + args.response_len)])


def make_synthetic_model(args, folder: Path) -> None:
    """Save the learner_step MoE (random, ``--dtype``) with a character tokenizer as an HF folder."""
    shape = _moe_args(args)
    shape.seq = max(shape.seq, 32768)  # max_position_embeddings of the saved config
    model, _ = learner_step.build(shape, torch.device("cpu"))
    model.to(torch.float32 if args.dtype == "float32" else torch.bfloat16).save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)


def _flops(args, tr, tokens_per_s: float) -> dict[str, float]:
    """Achieved model TFLOP/s (learner_step's count: 6 x active matmul params + causal attention)."""
    total = sum(p.numel() for p in tr.model.parameters())
    _, active, per_tok = learner_step.count_flops(_moe_args(args), total)
    tflops = per_tok * tokens_per_s / 1e12
    return {"seq": args.prompt_len + args.response_len, "tflops": tflops, "mfu_vs_peak": tflops / args.peak}


def _logprobs(tr, batch, impl: str):
    """Response-grid log-probs [B, R] of the current weights, by ``impl``'s own path."""
    p_lens, r_lens = batch["prompt_lens"].tolist(), batch["response_lens"].tolist()
    with torch.no_grad():
        if impl == "padded":
            pad = to_padded(batch, tr.pad_id)
            logits, _ = padded_forward(tr, tr.model, pad["input_ids"].to(tr.device), pad["attention_mask"].to(tr.device))
            full = token_logprobs(logits, pad["input_ids"].to(tr.device), tr.cfg.rollout.temperature).cpu()
            del logits
            out = torch.zeros(len(p_lens), max(r_lens))
            for i, (p, r) in enumerate(zip(p_lens, r_lens)):
                out[i, :r] = full[i, p - 1 : p - 1 + r]
            return out
        out = torch.zeros(len(p_lens), max(r_lens))
        _, _, mbs, plans = tr._prepare(batch)
        for m in plans[0][0]:
            out[m.rows] = tr._run(tr.model, m, max(r_lens))[0].cpu()
        return out


def main(argv=None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if args.child:
        return run_child(args)
    if not args.synthetic_moe and not Path(args.model).is_dir():
        print(f"streamrl-bench learner: --model {args.model!r} is not a folder (streamrl-prepare-model makes one)",
              file=sys.stderr)
        return 2
    impls = IMPLS if args.impl == "all" else tuple(args.impl.split(","))
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        print(f"streamrl-bench learner: --impl {args.impl!r}: unknown {bad}; known: all, {', '.join(IMPLS)}",
              file=sys.stderr)
        return 2
    try:
        parse_flex_options(args.flex_options)
    except ValueError as e:
        print(f"streamrl-bench learner: --flex-options: {e}", file=sys.stderr)
        return 2
    res: dict = {"model": args.model, "groups": args.groups, "group_size": args.group_size,
                 "response_len": args.response_len, "threads": args.threads, "budget": args.budget,
                 "device": args.device, "load_1min": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="streamrl-bench-learner-") as tmp:
        work = Path(tmp)
        extra = []
        if args.synthetic_moe:  # built once into --model (kept when it exists), else into the work dir
            folder = Path(args.model) if args.model != "models/smol" else work / "model"
            if not (folder / "config.json").exists():
                make_synthetic_model(args, folder)
            extra = ["--model", str(folder)]
        for impl in impls:
            cmd = [sys.executable, "-m", "streamrl.bench.learner", *raw, *extra,
                   "--child", impl, "--workdir", tmp]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            subprocess.run(cmd, check=True, env=env)
            r = json.loads((work / f"{impl}.json").read_text())
            if impl != "padded" and "padded" in res:
                r["speedup_vs_padded"] = res["padded"]["step_s"] / r["step_s"]
                r["peak_mem_ratio_vs_padded"] = r["peak_rss_GiB"] / res["padded"]["peak_rss_GiB"]
            res[impl] = r
            if not args.json:
                print(json.dumps(r))
    # off in every step (make_config): the comparison trains the same samples everywhere
    res["drop_zero_advantage"] = any(res[i]["drop_zero_advantage"] for i in impls)
    # headline figures: the learner's default step (shared prompts), and the plain packed one next to it
    for impl in ("shared", "packed"):
        if impl in res and "padded" in res:
            for k in ("speedup_vs_padded", "peak_mem_ratio_vs_padded", "max_abs_logprob_diff", "max_abs_grad_diff"):
                res[k if impl == "shared" else f"packed_{k}"] = res[impl][k]
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
