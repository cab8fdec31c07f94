"""What the reference and critic roles cost per learner step, colocated vs separate.

One packed batch (``--groups`` x ``--group-size`` random trajectories of the configured model),
timed ``--iters`` times after one warm-up (median ms):

* learner ``gradients()`` (forward + backward of one step, no optimizer): no KL; KL with the
  reference colocated (the learner runs it); KL from served ``ref_logprobs`` (the learner only
  reads them) -> the reference's cost moved off the learner;
* the reference server's scoring of the batch (what its own process pays instead);
* learner with the colocated value-head critic (``loss = vtrace``) vs ``advantage = gae`` from
  served values; the critic server's score + train step on the batch;
* memory: bytes of parameters (+ gradients + AdamW moments where trained) each role holds.

    python tools/bench_roles.py [--config configs/tiny.yaml] [--iters 5] [key=value ...]
    python tools/bench_roles.py --config configs/smol-dense.yaml learner.device=cuda --device cuda  # GPU
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from streamrl.bench.padded_reference import packed_gradients
from streamrl.config import load_config
from streamrl.learner.trainer import Trainer
from streamrl.roles.critic import CriticRole, load_value_model
from streamrl.roles.reference import ReferenceScorer, load_reference_model
from streamrl.roles.token_wire import TOKEN_KEYS
from streamrl.trajectory import pack_trajectories


def make_batch(vocab: int, groups: int, g: int, prompt_len: int, resp_len: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prompts, resp = [], []
    for _ in range(groups):
        p = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        for _ in range(g):
            prompts.append(p)
            resp.append(torch.randint(3, vocab, (resp_len,), generator=gen).tolist())
    n = len(prompts)
    return pack_trajectories(prompts, resp, [[-1.0] * len(r) for r in resp], [[0] * len(r) for r in resp],
                             torch.rand(n, generator=gen).tolist(), [i // g for i in range(n)], list(range(n)), 0, 0.0)


def timed(fn, iters: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(out), 2)


def nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--device", default="cpu", help="device of the role servers' models")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    cfg = lambda *extra: load_config(a.config, [*a.overrides, *extra])  # noqa: E731
    base = Trainer(cfg("learner.kl_coef=0", "learner.skip_no_signal=false"))
    td = make_batch(base.vocab_size, a.groups, a.group_size, a.prompt_len, a.response_len)
    fields = {k: td[k] for k in TOKEN_KEYS}
    out = {"batch": {"trajectories": a.groups * a.group_size, "response_tokens": int(td["response_lens"].sum())},
           "ms": {}, "bytes": {}}
    ms = out["ms"]
    ms["learner_no_kl"] = timed(lambda: packed_gradients(base, td), a.iters)
    del base
    colocated = Trainer(cfg("learner.kl_coef=0.05"))
    ms["learner_kl_reference_colocated"] = timed(lambda: packed_gradients(colocated, td), a.iters)
    out["bytes"]["reference_colocated_on_learner"] = nbytes(colocated.ref_model)
    del colocated
    scorer = ReferenceScorer(load_reference_model(cfg()), cfg().rollout.temperature, device=a.device)
    served = td.clone()
    served["ref_logprobs"] = scorer(fields)[0]
    ms["reference_server_score"] = timed(lambda: scorer(fields), a.iters)
    out["bytes"]["reference_server"] = nbytes(scorer.model)
    separate = Trainer(cfg("learner.kl_coef=0.05", "placement.reference=[cpu]"))
    ms["learner_kl_reference_separate"] = timed(lambda: packed_gradients(separate, served), a.iters)
    del separate, scorer
    vtrace = Trainer(cfg("learner.loss=vtrace"))
    ms["learner_value_head_vtrace"] = timed(lambda: packed_gradients(vtrace, td), a.iters)
    del vtrace
    c = cfg("placement.critic=[cpu]", "learner.advantage=gae")
    critic = CriticRole(c, load_value_model(c), a.device)
    with_values = td.clone()
    with_values["values"] = critic(fields)[0]
    critic.pending.clear()
    gae = Trainer(c)
    ms["learner_gae_from_served_values"] = timed(lambda: packed_gradients(gae, with_values), a.iters)

    def critic_round():
        critic({**fields, "reward": td["reward"]})
        critic.train_pending()

    ms["critic_server_score_and_train"] = timed(critic_round, a.iters)
    p = nbytes(critic.model)
    out["bytes"]["critic_server_params_grads_adam"] = 4 * p
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
