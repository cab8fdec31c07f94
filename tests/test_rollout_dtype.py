"""rollout.dtype: the engine holds and computes in its own dtype, versions arrive in the learner's.

A float32 learner publishes float32 tensors; an engine built with ``rollout.dtype = bfloat16``
holds bf16 parameters equal, bit for bit, to ``.to(torch.bfloat16)`` of what was published (full
versions), and merges adapter versions from the float32 ``W0`` (one rounding, not two).
"""
from __future__ import annotations

import pytest
import torch

from streamrl.config import load_config
from streamrl.engines.factory import build_engine
from streamrl.engines.precision import cast_for_engine, engine_dtype_name
from streamrl.models.factory import load_model_and_tokenizer
from streamrl.models.lora import SCALING_NAME, merged_weight
from tests.launch_helpers import launch_tiny

ENGINES = ["hf", "hf_fast"]


def _cfg(engine: str, *extra: str):
    return load_config(None, [f"rollout.engine={engine}", "rollout.dtype=bfloat16", "rollout.max_model_len=64",
                              "rollout.max_new_tokens=8", *extra])


def _version(cfg, seed: int) -> dict[str, torch.Tensor]:
    """A float32 full version: the learner's model of another seed (every value differs)."""
    model, _ = load_model_and_tokenizer(cfg.model, seed=seed)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_engine_dtype_defaults_to_the_models():
    assert engine_dtype_name(load_config(None, [])) == "float32"
    assert engine_dtype_name(load_config(None, ["rollout.dtype=bfloat16"])) == "bfloat16"
    assert engine_dtype_name(load_config(None, ["model.dtype=bfloat16", "rollout.dtype=float32"])) == "float32"


@pytest.mark.parametrize("engine", ENGINES)
def test_bf16_engine_loads_a_float32_version_as_its_cast(engine):
    cfg = _cfg(engine)
    model, tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
    assert next(model.parameters()).dtype == torch.float32  # the learner's dtype: the shared load is unchanged
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    eng = build_engine(cfg, model, tok)
    try:
        params = dict(eng.model.named_parameters())
        assert {p.dtype for p in params.values()} == {torch.bfloat16}
        assert all(torch.equal(params[n], t.to(torch.bfloat16)) for n, t in init.items())
        version = _version(cfg, seed=cfg.run.seed + 1)
        eng.load_weights(version.items())
        for n, t in version.items():
            assert params[n].dtype == torch.bfloat16 and torch.equal(params[n], t.to(torch.bfloat16)), n
        gen = eng.generate([[5, 6, 7]] * 2, 8, 1.0)  # decodes in bf16; log-probs stay float32 and finite
        lps = [x for row in gen.logprobs for x in row]
        assert lps and all(x <= 0.0 and x == x for x in lps)
    finally:
        eng.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_bf16_engine_merges_adapters_from_the_float32_base(engine):
    cfg = _cfg(engine, "model.lora.enabled=true", "model.lora.r=4", "model.lora.target_modules=[q_proj]")
    model, tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
    name = "model.layers.0.self_attn.q_proj.weight"
    w0 = dict(model.named_parameters())[name].detach().clone()  # float32
    eng = build_engine(cfg, model, tok)
    try:
        out, inp = w0.shape
        g = torch.Generator().manual_seed(1)
        a, b = torch.randn(4, inp, generator=g) * 0.05, torch.randn(out, 4, generator=g) * 0.05
        version = {f"model.layers.{i}.self_attn.q_proj.lora_{x}.weight": t
                   for i in range(cfg.model.num_layers) for x, t in (("A", a), ("B", b))}
        version[SCALING_NAME] = torch.tensor([2.0])
        eng.load_weights(version.items())
        got = dict(eng.model.named_parameters())[name]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, merged_weight(w0, a, b, 2.0).to(torch.bfloat16))
        # merging from the rounded base would round twice: some weights would differ by one bf16 step
        assert not torch.equal(got, merged_weight(w0.to(torch.bfloat16), a, b, 2.0))
        # a full version is the new base, kept in the learner's dtype too
        full = _version(cfg, seed=cfg.run.seed + 1)
        eng.load_weights(full.items())
        eng.load_weights(version.items())
        assert torch.equal(got, merged_weight(full[name], a, b, 2.0).to(torch.bfloat16))
    finally:
        eng.close()


def test_cast_keeps_no_base_when_dtypes_agree():
    cfg = load_config(None, ["model.lora.enabled=true", "model.lora.r=4", "rollout.dtype=float32"])
    model, _ = load_model_and_tokenizer(cfg.model, seed=0)
    assert cast_for_engine(model, cfg) == {} and next(model.parameters()).dtype == torch.float32


@pytest.mark.slow  # ~27 s on 2 shared cores
@pytest.mark.timeout(300)
def test_launch_bf16_rollout_on_a_float32_model_balances_its_ledger(tmp_path, repo, python):
    """A real run: float32 learner, bf16 hf_fast worker; every step trains, the ledger balances."""
    _, summary = launch_tiny(tmp_path, repo, python, steps=6, model={"dtype": "float32"},
                             rollout={"engine": "hf_fast", "dtype": "bfloat16", "max_model_len": 64},
                             learner={"groups_per_step": 4})
    acc = summary["accounting"]
    assert summary["steps"] == 6, summary
    assert acc["balanced"] and acc["duplicated"] == 0, acc
    assert summary["transport"]["transport/rejected"] == 0
