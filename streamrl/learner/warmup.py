"""The learner's warm-up: what its first step would pay once, paid while the workers roll out.

A learner's first step on CUDA compiles FlexAttention (forward and backward, then again with
dynamic shapes at the first micro-batch of a new length), builds the block mask with a compiled
kernel, grows the caching allocator to the step's peak, and with ``learner.compile`` compiles
every decoder layer and the head. Done in the first step, all of that starts only when the first
batch arrives, and the learner has by then already waited for the workers' first rollouts (at
1k tokens: ~13 s in the gpu-long recipe on the H200, model load and decode compile included).

So before it waits, the learner runs :meth:`streamrl.learner.trainer.Trainer.warm_up` on
:func:`synthetic_batch`: one forward/backward of a batch shaped like a step's (``groups_per_step``
groups of ``group_size`` random responses of ``max_new_tokens`` behind a shared prompt), then
drops the gradients. It takes no optimizer step and updates no router state; the weights, the
optimizer and the step count are exactly as before (``tests/test_learner_warmup.py``). The
learner's metrics report the time as ``learner/warmup_s`` and the e2e benchmark counts it as
busy time, not idle.
"""
from __future__ import annotations

import torch
from tensordict import TensorDict

from streamrl.config import Config
from streamrl.trajectory import pack_trajectories

# Prompt tokens of the synthetic groups when the rollout's max_model_len leaves room: the
# shipped tasks' prompts are 20-60 tokens with the chat template.
PROMPT_TOKENS = 64


def warm_up_pays(cfg: Config) -> bool:
    """True when ``learner.warm_up`` is on and the first step has first-call work to move:
    a CUDA learner (FlexAttention, the allocator) or ``learner.compile``. An eager CPU step
    costs the same the first time as later."""
    lc = cfg.learner
    return lc.warm_up and (lc.device.startswith("cuda") or lc.compile)


def synthetic_batch(cfg: Config, vocab_size: int, replay_layers: int = 0, top_k: int = 0,
                    num_experts: int = 0) -> TensorDict:
    """One step's worth of random trajectories, packed like the workers' batches.

    ``groups_per_step x group_size`` samples; each group shares one prompt of ``PROMPT_TOKENS``
    (fewer if ``rollout.max_model_len`` leaves less room) and every response is
    ``rollout.max_new_tokens`` long. Token ids are uniform in ``[0, vocab_size)``, rewards and
    behaviour log-probs random. ``replay_layers > 0`` adds R3 routed experts
    (``[len(response), replay_layers, top_k]`` distinct ids in ``[0, num_experts)`` per sample), so a
    routing-replay learner warms up the path it trains with. Seeded: the same batch on every rank.
    """
    rc, lc = cfg.rollout, cfg.learner
    gen = torch.Generator().manual_seed(0)
    prompt_len = max(1, min(PROMPT_TOKENS, rc.max_model_len - rc.max_new_tokens))
    r_len = rc.max_new_tokens
    prompts, responses, routed = [], [], []
    for _ in range(lc.groups_per_step):
        prompt = torch.randint(0, vocab_size, (prompt_len,), generator=gen).tolist()
        for _ in range(rc.group_size):
            prompts.append(prompt)
            responses.append(torch.randint(0, vocab_size, (r_len,), generator=gen).tolist())
            if replay_layers:
                routed.append(torch.rand(r_len, replay_layers, num_experts, generator=gen).argsort(-1)[..., :top_k])
    n = len(prompts)
    logprobs = (-3 * torch.rand(n, r_len, generator=gen)).tolist()
    return pack_trajectories(prompts, responses, logprobs, [[0] * r_len] * n, torch.rand(n, generator=gen).tolist(),
                             [i // rc.group_size for i in range(n)], list(range(n)), 0, 0.0,
                             routed_experts=routed or None)
