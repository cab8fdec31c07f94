"""LoRA learner (model.lora): logits and adapter gradients equal a plain PEFT model's on 1 rank
and on 2 FSDP2 gloo ranks (ep = 1 and ep = 2); a step trains only the adapters (also with activation
checkpointing); the reference is the frozen base."""
from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from torch.distributed.tensor import DTensor, distribute_tensor

from streamrl.config import load_config
from streamrl.learner.trainer import Trainer
from streamrl.models.factory import build_model
from streamrl.models.lora import SCALING_NAME, head_weight, merged_weight

from tests.dist_helpers import spawn_gloo

from test_checkpoint import REPO, make_batch

LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8",
        "model.lora.target_modules=[q_proj,v_proj,o_proj]"]


def lora_cfg(*extra):
    return load_config(f"{REPO}/configs/tiny.yaml", [*LORA, "learner.lr=1e-2", *extra])


def adapter_values(cfg) -> dict[str, torch.Tensor]:
    """Seeded non-zero adapter values by PEFT parameter name (B = 0 would hide A's gradient)."""
    ref = reference_peft(cfg)
    g = torch.Generator().manual_seed(5)
    return {n: torch.randn(p.shape, generator=g) * 0.1 for n, p in ref.named_parameters() if "lora_" in n}


def reference_peft(cfg):
    """The tiny model wrapped by PEFT directly (no StreamRL code between)."""
    model, _ = build_model(cfg.model, seed=cfg.run.seed)
    lc = cfg.model.lora
    return get_peft_model(model, PeftLoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=0.0,
                                                target_modules=list(lc.target_modules)))


def set_adapters(model, values: dict[str, torch.Tensor]) -> None:
    """Copy full ``values`` (PEFT names ``base_model.model.<name>``) into ``model``'s (maybe FSDP-sharded) adapters."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            full = values.get(f"base_model.model.{n}", values.get(n))
            if full is None:
                continue
            if isinstance(p, DTensor):
                full = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements)
            p.copy_(full)


def probe_loss(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [1, T, V], a scalar loss: next-token log-likelihood of ``ids``)."""
    logits = model(input_ids=ids, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).sum()
    return logits, -logp


def full_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[n.removeprefix("base_model.model.")] = g.detach().clone()
    return out


PROBE = torch.tensor([[1, 5, 9, 4, 12, 7, 3, 15, 8, 6]])


def published(tr) -> dict[str, torch.Tensor]:
    """``{version name: tensor}`` of the adapter version the trainer publishes now (its packed
    tensors unpacked by their parts, as a subscriber's views would be)."""
    out = {}
    for spec, pieces in zip(tr.param_specs, tr.full_tensors()):
        flat, start = torch.cat(pieces), 0
        assert flat.dtype == spec[1] and tuple(flat.shape) == spec[2]
        for name, shape in spec.parts:
            n = math.prod(shape)
            out[name] = flat[start: start + n].view(shape).clone()
            start += n
    return out


def _lora_logits_and_grads(rank, world, ep=1):
    cfg = lora_cfg(f"learner.ep={ep}")
    values = adapter_values(cfg)
    tr = Trainer(cfg)
    set_adapters(tr.model, values)
    version = published(tr)  # every rank iterates: one packed gather
    logits, loss = probe_loss(tr.model, PROBE)
    loss.backward()
    return {"logits": logits.detach(), "grads": full_grads(tr.model), "version": version}


def _reference_logits_and_grads():
    cfg = lora_cfg()
    ref = reference_peft(cfg)
    set_adapters(ref, adapter_values(cfg))
    logits, loss = probe_loss(ref, PROBE)
    loss.backward()
    return logits.detach(), full_grads(ref)


def _assert_equal_to_reference(out, ref_logits, ref_grads, atol):
    # the published adapters are exactly the values set (gathered from the shards, unpacked)
    values = {n.removeprefix("base_model.model.").replace(".default", ""): t
              for n, t in adapter_values(lora_cfg()).items()}
    assert sorted(out["version"]) == sorted([*values, SCALING_NAME])
    assert all(torch.equal(out["version"][n], t) for n, t in values.items())
    assert torch.allclose(out["logits"], ref_logits, atol=atol, rtol=0)
    assert sorted(out["grads"]) == sorted(ref_grads)
    assert all("lora_" in n for n in ref_grads)  # the base is frozen in both
    for n, g in ref_grads.items():
        assert torch.allclose(out["grads"][n], g, atol=atol, rtol=1e-5), (n, (out["grads"][n] - g).abs().max())


def test_one_rank_logits_and_grads_equal_peft():
    ref_logits, ref_grads = _reference_logits_and_grads()
    out = _lora_logits_and_grads(0, 1)
    # The trainer runs the expert-parallel MoE block, not the HF one: equal up to float32 rounding.
    _assert_equal_to_reference(out, ref_logits, ref_grads, atol=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ep", [1, 2])
def test_two_fsdp_ranks_logits_and_grads_equal_peft(ep):
    """2 ranks: FSDP2 over the wrapped model, and with ep = 2 the experts split over the ranks too."""
    ref_logits, ref_grads = _reference_logits_and_grads()
    for out in spawn_gloo(_lora_logits_and_grads, 2, ep, timeout_s=240):
        _assert_equal_to_reference(out, ref_logits, ref_grads, atol=1e-5)


def test_step_trains_only_adapters_and_publishes_them():
    cfg = lora_cfg()
    tr = Trainer(cfg)
    base_before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if not p.requires_grad}
    trained = [p for g in tr.optim.param_groups for p in g["params"]]
    assert trained and all(p.requires_grad for p in trained)
    assert sum(p.numel() for p in trained) < sum(p.numel() for p in base_before.values()) / 10
    before = published(tr)
    m = tr.step(make_batch(7, n=8))
    assert m["learner/skipped_no_signal"] == 0.0
    for n, p in tr.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_before[n]), n
    # one packed float32 tensor: every adapter (PEFT's float32) and the scaling, last
    assert [s[:2] for s in tr.param_specs] == [("lora.adapters.float32", torch.float32)]
    names = [n for n, _ in tr.param_specs[0].parts]
    assert names[-1] == SCALING_NAME and all(".lora_" in n for n in names[:-1])
    assert len(names) == len(trained) + 1
    after = published(tr)
    assert list(after) == names and all(tuple(after[n].shape) == s for n, s in tr.param_specs[0].parts)
    assert float(after[SCALING_NAME]) == cfg.model.lora.alpha / cfg.model.lora.r
    assert any(not torch.equal(after[n], before[n]) for n in names)  # the adapters moved


def test_kl_reference_is_the_frozen_base():
    cfg = lora_cfg("learner.kl_coef=0.1")
    tr = Trainer(cfg)
    assert tr.ref_model is None  # no second model in memory
    set_adapters(tr.model, adapter_values(cfg))
    base, _ = build_model(cfg.model, seed=cfg.run.seed)
    with torch.no_grad():
        with tr.lora.reference():
            ref_logits = tr.model(input_ids=PROBE, use_cache=False).logits
        policy_logits = tr.model(input_ids=PROBE, use_cache=False).logits
        assert torch.allclose(ref_logits, base(input_ids=PROBE, use_cache=False).logits, atol=1e-5, rtol=0)
        assert not torch.allclose(policy_logits, ref_logits)
    assert tr.step(make_batch(3, n=8))["learner/skipped_no_signal"] == 0.0


def test_lm_head_adapter_reaches_the_chunked_logprob_head():
    """The learner's log-probs read the head's weight (no lm_head call): with an adapted head
    that weight must be W0 + scaling * B @ A, with gradients into A and B; the base when disabled."""
    cfg = lora_cfg("model.lora.target_modules=[q_proj,lm_head]")
    tr = Trainer(cfg)
    values = adapter_values(cfg)
    set_adapters(tr.model, values)
    head = tr.model.get_output_embeddings()
    a, b = (values[f"base_model.model.lm_head.lora_{k}.default.weight"] for k in "AB")
    want = merged_weight(head.base_layer.weight, a, b, cfg.model.lora.alpha / cfg.model.lora.r)
    w = head_weight(head)
    assert torch.allclose(w, want, atol=1e-6, rtol=0)
    w.sum().backward()
    assert head.lora_A["default"].weight.grad is not None and head.lora_B["default"].weight.grad.abs().sum() > 0
    with tr.lora.reference():
        assert head_weight(head) is head.base_layer.weight


def test_activation_checkpointing_gives_the_same_step():
    outs = []
    for ac in ("false", "true"):
        tr = Trainer(lora_cfg(f"learner.activation_checkpointing={ac}"))
        m = tr.step(make_batch(7, n=8))
        outs.append((m["learner/loss"], published(tr)))
    assert outs[0][0] == pytest.approx(outs[1][0], rel=1e-6)
    assert list(outs[0][1]) == list(outs[1][1])
    for n, a in outs[0][1].items():
        assert torch.allclose(a, outs[1][1][n], atol=1e-6, rtol=0)
