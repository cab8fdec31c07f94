"""The learner step's host preparation on CPU: response grid, advantages and every micro-batch
(packing, the attention layout), timed and optionally under cProfile.

What the GPU waits for before a step's first kernel is this work for micro-batch 0 (the trainer
builds each later one while the device runs the one before); its size does not depend on the
model's (the tiny config's model is used), only on the batch's shape and, with ``--replay``,
on the R3 expert ids of ``--layers`` MoE layers. Run from the repo root::

    python tools/learner_host_profile.py --seq 4096 --tokens 32768 --attention sdpa --profile 5
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from streamrl.config import load_config
from streamrl.learner.trainer import Trainer
from streamrl.trajectory import pack_trajectories


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (prompt + response)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32768, help="tokens per step (a multiple of --seq)")
    p.add_argument("--budget", type=int, default=32768, help="learner.max_tokens_per_microbatch")
    p.add_argument("--attention", default="sdpa", help="learner.attention (segments: the CPU default)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--profile", type=int, default=0, help="then this many preparations under cProfile")
    args = p.parse_args(argv)
    if args.tokens % args.seq or args.seq <= args.prompt_len:
        p.error("--tokens must be a multiple of --seq, and --seq longer than --prompt-len")
    torch.set_num_threads(1)
    resp_len, n = args.seq - args.prompt_len, args.tokens // args.seq
    tr = Trainer(load_config("configs/tiny.yaml", [
        f"learner.attention={args.attention}", f"learner.max_tokens_per_microbatch={args.budget}",
        "learner.skip_no_signal=false", f"rollout.max_new_tokens={resp_len}"]))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 30, (args.prompt_len,), generator=g).tolist() for _ in range(n)]
    resp = [torch.randint(3, 30, (resp_len,), generator=g).tolist() for _ in range(n)]
    lps = [(-torch.rand(resp_len, generator=g)).tolist() for _ in range(n)]
    batch = pack_trajectories(prompts, resp, lps, [[0] * resp_len] * n, torch.rand(n, generator=g).tolist(),
                              list(range(n)), list(range(n)), 0, 0.0)

    def prepare() -> tuple[int, float]:
        t0 = time.perf_counter()
        micro = tr._prepare(batch)[3][0][0]
        micro.prefetch(0)
        first = time.perf_counter() - t0
        for i in range(1, len(micro)):
            micro.prefetch(i)
        return len(micro), first

    prepare()  # warm-up
    total, first = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        count, f = prepare()
        total.append(time.perf_counter() - t0)
        first.append(f)
    print(f"{n} x {args.seq} tokens, {count} micro-batches of <= {args.budget}, attention={tr.attention}: "
          f"prepare_s median {statistics.median(total) * 1e3:.2f} ms (min {min(total) * 1e3:.2f}), "
          f"first_kernel_s median {statistics.median(first) * 1e3:.2f} ms (min {min(first) * 1e3:.2f})")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.profile):
            prepare()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
