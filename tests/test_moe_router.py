"""Router freeze / unfreeze gate, router EMA, routing replay, deterministic eval routing;
EP block equivalence for every supported HF MoE layout and dense models."""
from __future__ import annotations

import copy

import pytest
import torch

from streamrl.config import load_config
from streamrl.learner.trainer import Trainer
from streamrl.models.moe import convert_moe_blocks

from tests.learner_helpers import evaluate_logprobs, router_ema_state

from test_checkpoint import REPO, make_batch


def _trainer(*extra):
    return Trainer(load_config(f"{REPO}/configs/tiny.yaml", ["learner.lr=1e-2", *extra]))


def _routers(tr):
    return {n: p.detach().clone() for n, p in tr.router.params}


def test_router_frozen_for_warmup_then_trains():
    tr = _trainer("learner.router_freeze_steps=2")
    r0 = _routers(tr)
    for s in range(2):
        m = tr.step(make_batch(s))
        assert m["moe/router_frozen"] == 1.0
        assert all(torch.equal(r0[n], p) for n, p in tr.router.params)
    m = tr.step(make_batch(3))
    assert m["moe/router_frozen"] == 0.0
    assert any(not torch.equal(r0[n], p) for n, p in tr.router.params)


def test_unfreeze_gate_holds_until_threshold():
    tr = _trainer("learner.router_freeze_steps=1", "learner.router_unfreeze_min_entropy=1.01")  # unreachable
    for s in range(3):
        assert tr.step(make_batch(s))["moe/router_frozen"] == 1.0
    assert tr.router.update_freeze(5, {"moe/router_entropy": 1.02}) is False  # gate passes -> unfrozen


def test_router_ema_is_published():
    tr = _trainer("learner.router_ema=0.5")
    r0 = _routers(tr)
    tr.step(make_batch(0))
    ema = router_ema_state(tr)
    assert set(ema) == set(r0)
    for n, p in tr.router.params:
        assert torch.allclose(ema[n], 0.5 * r0[n] + 0.5 * p.detach(), atol=1e-6)
    published = dict(zip([s[0] for s in tr.param_specs], tr.full_tensors()))
    for n in ema:
        assert torch.equal(published[n], ema[n])


def test_routing_replay_and_eval_determinism():
    tr = _trainer("learner.routing_replay=true")
    b = make_batch(0)
    b["routed_experts"] = torch.zeros(int(b["response_lens"].sum()), 2, 2, dtype=torch.int16)
    b["routed_experts"][:, :, 1] = 1  # force experts (0, 1) on every response position
    from streamrl.bench.padded_reference import padded_forward, padded_routed_experts
    from streamrl.trajectory import to_padded

    pad = to_padded(b, tr.pad_id)
    rep = padded_routed_experts(b, pad["input_ids"].shape[1], 2)
    p0 = int(b["prompt_lens"][0])
    assert rep[0, p0 - 1].tolist() == [[0, 1], [0, 1]] and rep[0, 0].tolist() == [[-1, -1], [-1, -1]]
    tr.model.train()
    logits_rep, routers = padded_forward(tr, tr.model, pad["input_ids"], pad["attention_mask"], rep)
    logits_own, _ = padded_forward(tr, tr.model, pad["input_ids"], pad["attention_mask"])
    assert not torch.allclose(logits_rep, logits_own)
    a = evaluate_logprobs(tr, pad["input_ids"], pad["attention_mask"])
    assert torch.equal(a, evaluate_logprobs(tr, pad["input_ids"], pad["attention_mask"]))
    with pytest.raises(ValueError, match="layers"):
        padded_routed_experts(b, pad["input_ids"].shape[1], 3)


def _tiny_hf(arch):
    import transformers as T

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=32, num_experts_per_tok=2)
    if arch == "qwen2_moe":
        cfg = T.Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                               intermediate_size=16, norm_topk_prob=False)
        return T.Qwen2MoeForCausalLM(cfg)
    if arch == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(**common, num_local_experts=4, intermediate_size=16))
    if arch == "olmoe":
        return T.OlmoeForCausalLM(T.OlmoeConfig(**common, num_experts=4, intermediate_size=16))
    if arch == "llama":  # dense: nothing to convert
        return T.LlamaForCausalLM(T.LlamaConfig(**{k: v for k, v in common.items() if k != "num_experts_per_tok"},
                                               intermediate_size=16))
    raise AssertionError(arch)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "olmoe", "llama"])
def test_converted_model_matches_hf(arch):
    torch.manual_seed(0)
    hf = _tiny_hf(arch).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("gate.weight"):
                p.normal_(0, 1)  # spread the routing
    ours = copy.deepcopy(hf)
    blocks = convert_moe_blocks(ours)
    assert (len(blocks) == 0) == (arch == "llama")
    ours.train()  # train-mode routing (topk) like HF
    hf.train()
    ids = torch.randint(0, 64, (2, 7))
    assert torch.allclose(hf(input_ids=ids).logits, ours(input_ids=ids).logits, atol=1e-5)
    assert sorted(n for n, _ in hf.named_parameters()) == sorted(n for n, _ in ours.named_parameters())
