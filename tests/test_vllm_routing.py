"""Routing capture in the real vllm(-cpu) engine, for R3 routing replay (tiny Qwen3-MoE, fp32).

The routes vLLM returns for sampled responses must be what the transformers model routes
teacher-forced on the same sequences, aligned like the hf engines' (row j = the position that
predicted response token j), and replaying them in the learner's EP block must give
log-probs at least as close to vLLM's behaviour log-probs as free routing does.
"""
from __future__ import annotations

import copy

import pytest
import torch

from streamrl.bench.padded_reference import padded_routed_experts
from streamrl.config import ModelConfig
from streamrl.models.factory import build_model, save_model
from streamrl.models.moe import convert_moe_blocks
from streamrl.trajectory import pack_trajectories, to_padded

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
TEMP = 1.0
MAX_NEW = 10


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    from streamrl.engines.vllm_engine import VLLMEngine

    model, tok = build_model(ModelConfig(max_positions=256), seed=0)
    folder = tmp_path_factory.mktemp("tiny-moe-routing")
    save_model(model, tok, folder)
    engine = VLLMEngine(str(folder), dtype="float32", kv_cache_bytes=64 << 20, max_model_len=256, seed=0,
                        record_routing=True)
    yield model.eval(), tok, engine
    engine.close()


def _prompts(tok) -> list[list[int]]:
    short = [f"{i}{i + 3}{i * 7 % 10}{(i + 5) % 10}=" for i in range(6)]
    long = "0123456789" * 14 + "42="  # > one KV block: shared by a group, so the prefix cache is hit
    return [tok.encode(t, add_special_tokens=False) for t in short + [long] * 4]


@torch.no_grad()
def _hf_routes(model, prompt: list[int], response: list[int], k: int) -> torch.Tensor:
    """Top-k experts the HF model routes teacher-forced: [len(response), L, k] (sorted ids)."""
    out = model(input_ids=torch.tensor([prompt + response]), output_router_logits=True)
    lo = len(prompt) - 1
    per_layer = [logits.float().softmax(-1).topk(k, -1).indices[lo: lo + len(response)] for logits in out.router_logits]
    return torch.stack(per_layer, dim=1).sort(-1).values


def _agreement(model, prompts, gen, k: int) -> tuple[int, int]:
    """(equal (token, layer) top-k sets, all sets)."""
    equal = total = 0
    for p, toks, routes in zip(prompts, gen.tokens, gen.routed_experts):
        assert routes.dtype == torch.int16 and routes.shape == (len(toks), model.config.num_hidden_layers, k)
        assert int(routes.min()) >= 0, "a response position has no recorded route"
        same = (routes.long().sort(-1).values == _hf_routes(model, p, toks, k)).all(-1)  # [T, L]
        equal += int(same.sum())
        total += same.numel()
    return equal, total


def test_vllm_routes_equal_hf_teacher_forced(routed):
    model, tok, engine = routed
    k = model.config.num_experts_per_tok
    prompts = _prompts(tok)
    assert engine.native_routing or engine.recorder is not None
    gen = engine.generate(prompts, MAX_NEW, TEMP)
    equal, total = _agreement(model, prompts, gen, k)
    print(f"vllm vs hf teacher-forced routing: {equal}/{total} (token, layer) top-k sets equal "
          f"({'native' if engine.native_routing else 'router capture hooks'})")
    assert equal >= 0.99 * total, f"only {equal}/{total} routing sets agree"


def test_routes_survive_reload_and_inflight_path(routed):
    """After a weight reload (modules re-processed) and through the step-loop path of
    in-flight updates, routes are still recorded and still equal HF's."""
    model, tok, engine = routed
    k = model.config.num_experts_per_tok
    prompts = _prompts(tok)
    engine.load_weights(model.named_parameters())
    gen = engine.generate(prompts, MAX_NEW, TEMP, between_steps=lambda: None, version=3)
    assert gen.versions == [[3] * len(t) for t in gen.tokens]
    equal, total = _agreement(model, prompts, gen, k)
    assert equal >= 0.99 * total, f"only {equal}/{total} routing sets agree after reload / in the step loop"


@torch.no_grad()
@pytest.mark.parametrize("router_drift", [0.0, 0.3])
def test_learner_replay_of_vllm_routes_is_at_least_as_close_as_free_routing(routed, router_drift):
    """router_drift = 0: learner == engine weights (the fp32 parity case). router_drift > 0:
    the learner's routers moved (as after an optimizer step): some tokens route differently,
    and replaying the engine's experts must bring the log-probs closer to the behaviour ones."""
    model, tok, engine = routed
    prompts = _prompts(tok)
    gen = engine.generate(prompts, MAX_NEW, TEMP)
    n = len(prompts)
    td = pack_trajectories(prompts, gen.tokens, gen.logprobs, [[0] * len(t) for t in gen.tokens], [0.0] * n,
                           list(range(n)), list(range(n)), 0, 0.0, routed_experts=gen.routed_experts)
    learner = copy.deepcopy(model)
    blocks = convert_moe_blocks(learner)
    learner.eval()
    g = torch.Generator().manual_seed(4)
    for blk in blocks:
        w = blk.gate.weight
        w.add_(router_drift * w.std() * torch.randn(w.shape, generator=g))
    padded = to_padded(td, tok.pad_token_id or 0)
    ids, attn, mask = padded["input_ids"], padded["attention_mask"], padded["loss_mask"].bool()
    replay = padded_routed_experts(td, ids.shape[1], len(blocks))
    errors = {}
    for mode in ("free", "replay"):
        for i, b in enumerate(blocks):
            b.replay = None if mode == "free" else replay[:, :, i].reshape(-1, replay.shape[-1])
        logits = learner(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
        for b in blocks:
            b.replay = None
        lp = torch.log_softmax(logits / TEMP, -1).gather(-1, ids[:, 1:, None])[..., 0]
        diff = (lp - padded["behaviour_logprobs"]).abs()[mask]
        errors[mode] = (diff.max().item(), diff.mean().item())
    print(f"router drift {router_drift}: |learner - vllm behaviour log-prob| max/mean: free {errors['free'][0]:.2e}/{errors['free'][1]:.2e}, "
          f"replay {errors['replay'][0]:.2e}/{errors['replay'][1]:.2e}")
    assert errors["replay"][0] <= errors["free"][0] + 1e-6
    assert errors["replay"][1] <= errors["free"][1] + 1e-7
    if router_drift == 0:
        assert errors["replay"][0] < 1e-4
    else:
        assert errors["replay"][1] < errors["free"][1], "replay did not help where routes differ"
