"""LoRA with ``learner.compile``: a learner step with compiled decoder layers (and compiled
log-prob head kernels) gives eager's loss and adapter gradients, and trains only the adapters.

The config covers the parts compile could get wrong with PEFT: adapters inside the compiled
layers (q/v/o), an adapted ``lm_head`` read by the compiled head (``head_weight``), and a KL
term whose reference is the same compiled layers under ``disable_adapter()`` (the graphs must
not keep the adapters on). One gloo rank in a fresh process (its own dynamo caches); compiling
on 2 CPU cores takes minutes, hence ``slow``.
"""
from __future__ import annotations

import os

import pytest
import torch

from streamrl.learner.trainer import Trainer

from tests.dist_helpers import spawn_gloo

from test_checkpoint import make_batch
from test_lora_trainer import adapter_values, lora_cfg, set_adapters

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

EXTRA = ["model.lora.target_modules=[q_proj,v_proj,o_proj,lm_head]", "learner.kl_coef=0.1"]


def _step(rank, world, compile_layers):
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # no compiler worker pool on a loaded 2-core box
    from torch._dynamo.utils import counters

    cfg = lora_cfg(*EXTRA, f"learner.compile={str(compile_layers).lower()}")
    tr = Trainer(cfg)
    set_adapters(tr.model, adapter_values(cfg))  # B != 0: A gets a gradient too
    names = {id(p): n for n, p in tr.model.named_parameters()}
    trained = [p for g in tr.optim.param_groups for p in g["params"]]
    grads: dict[str, torch.Tensor] = {}
    step = tr.optim.step

    def keep_grads(*args, **kwargs):  # the step's gradients, as AdamW receives them
        grads.update({names[id(p)]: p.grad.detach().clone() for p in trained if p.grad is not None})
        return step(*args, **kwargs)

    tr.optim.step = keep_grads
    m = tr.step(make_batch(7, n=8))
    return {"loss": m["learner/loss"], "kl": m["learner/kl_ref"], "grads": grads,
            "trained": [names[id(p)] for p in trained],
            "frozen": [n for n, p in tr.model.named_parameters() if not p.requires_grad],
            "graphs": counters["stats"]["unique_graphs"]}


def test_compiled_lora_step_matches_eager():
    eager = spawn_gloo(_step, 1, False, timeout_s=1100)[0]
    compiled = spawn_gloo(_step, 1, True, timeout_s=1100)[0]
    assert eager["graphs"] == 0 and compiled["graphs"] > 0  # compiled for real, and only there
    # only the adapters are in the optimizer: every lora_A / lora_B, nothing of the base
    assert compiled["trained"] == eager["trained"]
    assert compiled["trained"] and all(".lora_A." in n or ".lora_B." in n for n in compiled["trained"])
    assert any(n.startswith("lm_head.lora_") for n in compiled["trained"])
    assert compiled["frozen"] and not any(".lora_" in n for n in compiled["frozen"])
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-5, abs=1e-7)
    assert eager["kl"] != 0.0 and compiled["kl"] == pytest.approx(eager["kl"], rel=1e-4, abs=1e-8)
    assert sorted(compiled["grads"]) == sorted(eager["grads"]) == sorted(eager["trained"])
    for n, g in eager["grads"].items():
        assert g.abs().sum() > 0, n
        assert torch.allclose(compiled["grads"][n], g, atol=1e-6, rtol=1e-4), (n, (compiled["grads"][n] - g).abs().max())
