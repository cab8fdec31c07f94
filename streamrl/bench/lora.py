"""``streamrl-bench lora``: a LoRA version against a full-weights version, same model, same run.

The model is built from a config with random weights (no download): by default SmolLM2-135M's
shapes (Llama, hidden 576, 30 layers, 9 heads / 3 kv heads, MLP 1536, vocab 49152). One
process is the learner and the rollout engine: the publisher writes each version into the
shared-memory store (real checksums; a real Redis, reached over its Unix socket as the launcher's
processes on the Redis host reach it), the subscriber fetches, verifies and loads it into an
engine's parameters (a full version is copied; an adapter version is merged from the
base, :mod:`streamrl.engines.adapter_merge`). The adapter version is the learner's: its LoRA
policy's packed tensor, packed in each round (the pack is part of the publish seconds).

What precedes each timed publish is what precedes it in the learner: an AdamW step over the
tensors the version carries (the full model's parameters, or the adapters; zero gradients and
no weight decay, so the values stay put while the memory traffic is a real step's). Without it
(``--no-learner-step``) the publish follows the previous round's engine load in this same
process, which no learner's publish does: for the adapter version, whose bytes fit in the
cache, that measures a cache emptied by the rollout side's merge, not the publish; the full
version streams from memory either way.

Reported per kind: bytes, tensors (a packed one's parts), publish seconds,
fetch + verify + load seconds and end-to-end seconds (best of ``--repeat``); then the ratios
(target: the adapter's publish-time ratio at most twice its bytes ratio), and the merged vs
unmerged figure: seconds to merge every adapted projection against what the unmerged adapters
add to one decode step's projections at batch ``--batch``.

Example:
    streamrl-bench lora --json                 # r = 8 on q/k/v/o, float32, SmolLM2-135M shapes
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from streamrl.config import LoraConfig
from streamrl.coord.coordinator import Coordinator
from streamrl.engines.adapter_merge import EngineWeights
from streamrl.launcher.redis_server import RedisServer
from streamrl.learner.lora_policy import LoraPolicy
from streamrl.models.lora import SCALING_NAME, adapter_parameters, lora_scaling
from streamrl.weights.layout import tensor_count
from streamrl.weights.publisher import WeightPublisher
from streamrl.weights.subscriber import WeightSubscriber


class _Engine:
    """The rollout side: an engine's parameters and its version loader."""

    def __init__(self, model):
        self.weights = EngineWeights(dict(model.named_parameters()))

    def load_weights(self, named) -> None:
        self.weights.load(named)


def build(args):
    """(engine model, LoRA learner model, its LoRA policy) of the same random base."""
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)
    dtype = getattr(torch, args.dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        engine = LlamaForCausalLM(cfg).to(dtype)
    learner = LlamaForCausalLM(cfg).to(dtype)
    learner.load_state_dict(engine.state_dict())
    lora = LoraConfig(enabled=True, r=args.r, alpha=2.0 * args.r, target_modules=args.targets.split(","))
    policy = LoraPolicy(learner, lora, seed=0)
    with torch.no_grad():  # B = 0 at init: make the merge real work
        for _, _, p in adapter_parameters(learner):
            p.normal_(0, 0.01)
    return engine, learner, policy


def versions(engine, policy: LoraPolicy):
    """{kind: (specs, tensors of one version: a callable, the parameters the learner trains for it)}
    of a full version and an adapter version."""
    full = [p.detach() for _, p in engine.named_parameters()]
    full_specs = [(n, p.dtype, tuple(p.shape)) for n, p in engine.named_parameters()]
    return {"full": (full_specs, lambda: iter(full), list(engine.parameters())),
            "lora": (policy.specs(), policy.full_tensors, policy.trainable())}


class LearnerStep:
    """The learner's optimizer step before a publish: fused AdamW (the trainer's) over ``params``
    with zero gradients and no weight decay: every byte of the parameters and their two moments
    is read and written as in a real step, and the values do not change."""

    def __init__(self, params: list[torch.nn.Parameter]):
        for p in params:
            p.grad = torch.zeros_like(p)
        self.params = params
        self.optim = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0, fused=True)

    def __call__(self) -> None:
        self.optim.step()

    def close(self) -> None:
        """Free the moments and gradients (about 3x the parameters' bytes)."""
        self.optim.state.clear()
        for p in self.params:
            p.grad = None


def adapter_items(learner, lora) -> list[tuple[str, torch.Tensor]]:
    """An adapter version as the engine receives it: (version name, tensor) of each adapter, then the scaling."""
    items = [(e, p.detach()) for _, e, p in adapter_parameters(learner)]
    return items + [(SCALING_NAME, torch.tensor([lora_scaling(lora)], dtype=torch.float32))]


def time_versions(url: str, engine, kinds: dict, repeat: int, learner_step: bool = True) -> dict:
    """Publish + load each kind ``repeat`` times (each publish after a :class:`LearnerStep` over
    the kind's trained parameters, untimed, when ``learner_step``); best seconds of each phase per kind."""
    run = f"bench-lora-{uuid.uuid4().hex[:8]}"
    coord = Coordinator(url, run)
    pub = WeightPublisher(coord, run, plane="shm", keep=2)
    sub = WeightSubscriber(coord, plane="shm")
    target = _Engine(engine)
    out, version = {}, 0
    try:
        for kind, (specs, tensors, trained) in kinds.items():
            count = tensor_count(specs)
            best: dict[str, float] = {}
            step = LearnerStep(trained) if learner_step else None
            for _ in range(repeat + 1):  # the first round allocates the store's pages
                if step is not None:
                    step()
                t0 = time.perf_counter()
                timings = pub.publish(version, specs, tensors())
                t1 = time.perf_counter()
                assert sub.load(target, 0, version) == version
                t2 = time.perf_counter()
                row = {"publish_s": t1 - t0, "load_s": t2 - t1, "e2e_s": t2 - t0}
                best = {k: min(v, best.get(k, v)) for k, v in row.items()}
                bytes_ = int(timings["weights/bytes"])
                version += 1
            if step is not None:
                step.close()
            out[kind] = {"bytes": bytes_, "tensors": count, "published_tensors": len(specs),
                         **{k: round(v, 5) for k, v in best.items()}}
    finally:
        sub.close()
        pub.close()
    return out


def merge_vs_unmerged(engine, learner, lora, batch: int) -> dict:
    """Seconds to merge every adapted projection vs the unmerged adapters' cost per decode step."""
    base = dict(engine.named_parameters())
    pairs = {}
    for _, e, p in adapter_parameters(learner):
        pairs.setdefault(e.rsplit(".", 2)[0], []).append(p.detach())
    mods = [(base[f"{m}.weight"].detach(), a, b) for m, (a, b) in pairs.items()]
    s = lora_scaling(lora)
    version = adapter_items(learner, lora)
    weights = EngineWeights({k: v.detach().clone() for k, v in base.items()})

    def best(fn, n):
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts)

    x = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w, _, _ in mods}
    merged = best(lambda: weights.load(version), 5)
    plain = best(lambda: [x[w.shape[1]] @ w.T for w, _, _ in mods], 20)
    extra = best(lambda: [x[w.shape[1]] @ w.T + (x[w.shape[1]] @ a.T.to(w.dtype)) @ b.T.to(w.dtype) * s
                          for w, a, b in mods], 20)
    return {"projections": len(mods), "merge_s": round(merged, 5), "decode_projections_s": round(plain, 5),
            "decode_projections_unmerged_s": round(extra, 5),
            "break_even_decode_steps": round(merged / max(extra - plain, 1e-9), 1)}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="streamrl-bench lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--r", type=int, default=8, help="adapter rank")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="target modules, comma-separated")
    p.add_argument("--layers", type=int, default=30, help="decoder layers")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=16, help="decode batch of the merged vs unmerged figure")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds per kind (best is kept)")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    p.add_argument("--no-learner-step", dest="learner_step", action="store_false",
                   help="publish right after the previous round's engine load, without the learner's AdamW step")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.r < 1 or args.layers < 1 or args.repeat < 1:
        raise ValueError(f"--r {args.r} / --layers {args.layers} / --repeat {args.repeat}: each must be >= 1")
    engine, learner, policy = build(args)
    server = None
    url = args.redis_url
    if url is None:
        # the Unix socket, as the launcher's processes on the Redis host use it
        server = RedisServer(Path(tempfile.mkdtemp(prefix="streamrl-bench-redis-"))).start()
        url = server.local_url
    try:
        rows = time_versions(url, engine, versions(engine, policy), args.repeat, args.learner_step)
    finally:
        if server is not None:
            server.stop()
    full, ad = rows["full"], rows["lora"]
    out = {"bench": "lora", "r": args.r, "targets": args.targets, "dtype": args.dtype, "layers": args.layers,
           "learner_step": args.learner_step, "redis": urlparse(url).scheme, **rows,
           "bytes_ratio": round(ad["bytes"] / full["bytes"], 5),
           "publish_ratio": round(ad["publish_s"] / full["publish_s"], 5),
           "e2e_ratio": round(ad["e2e_s"] / full["e2e_s"], 5),
           "merge": merge_vs_unmerged(engine, learner, policy.cfg, args.batch)}
    out["publish_ratio_over_bytes_ratio"] = round(out["publish_ratio"] / out["bytes_ratio"], 2)
    for kind in ("full", "lora"):
        r = rows[kind]
        print(f"{kind:>4}: {r['bytes'] / 2**20:9.2f} MiB  publish {r['publish_s'] * 1e3:8.1f} ms  "
              f"load {r['load_s'] * 1e3:8.1f} ms  e2e {r['e2e_s'] * 1e3:8.1f} ms")
    print(f"Redis over {'a Unix socket' if out['redis'] == 'unix' else 'TCP'}; merge {out['merge']}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
