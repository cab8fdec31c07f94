"""vLLM + LoRA: an adapter version reloads the vllm(-cpu) engine with the merged weights of the hf
engines and the export. Its teacher-forced log-probs equal, exactly, those after loading the hf
merge as a full version (the same weights, bit for bit), and the merged HF model's within the
vLLM-vs-HF tolerance; every version merges from the folder's base, never from the last one."""
from __future__ import annotations

import copy

import pytest
import torch

from streamrl.config import load_config
from streamrl.engines.adapter_merge import EngineWeights
from streamrl.models.factory import build_model, save_model
from streamrl.models.lora import SCALING_NAME, adapter_parameters, apply_lora, lora_scaling
from streamrl.weights.layout import Layout, PackedSpec

from test_checkpoint import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
TOL = 1e-4  # vLLM vs HF, fp32 (tests/test_vllm_engine.py)
# k_proj without v_proj: vLLM's packed qkv_proj must be reloaded whole (v from the folder's base)
LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8",
        "model.lora.target_modules=[q_proj,k_proj,o_proj,lm_head]"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = load_config(f"{REPO}/configs/tiny.yaml", LORA)
    model, tok = build_model(cfg.model, seed=cfg.run.seed)
    folder = tmp_path_factory.mktemp("tiny-lora")
    save_model(model, tok, folder)
    return cfg, model, tok, str(folder)


@pytest.fixture(scope="module")
def engine(tiny):
    from streamrl.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(tiny[3], dtype="float32", kv_cache_bytes=64 << 20, max_model_len=256, seed=0)
    yield eng
    eng.close()


def adapter_version(cfg, model, seed: int) -> list[tuple[str, torch.Tensor]]:
    """A version of random adapters (B != 0) on a PEFT copy of ``model``: (name, tensor) + scaling."""
    wrapped = copy.deepcopy(model)
    apply_lora(wrapped, cfg.model.lora)  # in place: the learner's names, without PEFT's prefix
    g = torch.Generator().manual_seed(seed)
    items = [(e, torch.randn(p.shape, generator=g) * 0.2) for _, e, p in adapter_parameters(wrapped)]
    return items + [(SCALING_NAME, torch.tensor([lora_scaling(cfg.model.lora)]))]


def as_published(items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``items`` as the subscriber hands out an adapter version: views of one packed float32
    tensor (:class:`~streamrl.weights.layout.PackedSpec`), laid out by the weights layout."""
    spec = PackedSpec("lora.adapters.float32", torch.float32, [(n, tuple(t.shape)) for n, t in items])
    layout = Layout.plan([spec], 1 << 30)
    buf = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    buf[: layout.tensors[0]["nbytes"]].view(torch.float32).copy_(torch.cat([t.reshape(-1) for _, t in items]))
    return layout.views(0, buf)


def hf_merged(model, items) -> dict[str, torch.Tensor]:
    """The hf engines' weights after ``items``: {runtime name: merged tensor}."""
    weights = EngineWeights({n: p.detach().clone() for n, p in model.named_parameters()})
    weights.load(items)
    return weights.params


def hf_scores(model, params, seqs, start) -> list[list[float]]:
    ref = copy.deepcopy(model)
    ref.load_state_dict(params, strict=False)
    out = []
    with torch.no_grad():
        for s, st in zip(seqs, start):
            logits = ref(input_ids=torch.tensor([s])).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(s[1:]).unsqueeze(-1))[:, 0]
            out.append(lp[st - 1:].tolist())
    return out


def test_adapter_versions_reload_vllm_with_the_hf_merge(engine, tiny):
    cfg, model, tok, _ = tiny
    prompts = [tok.encode(f"{i}{i + 3}{i * 7 % 10}{(i + 5) % 10}=", add_special_tokens=False) for i in range(6)]
    seqs = [p + tok.encode("31415926", add_special_tokens=False) for p in prompts]
    start = [len(p) for p in prompts]
    base = engine.score(seqs, start)
    scores = {}
    for v in (1, 2):  # version 2 merges from the base, not on top of version 1
        items = adapter_version(cfg, model, seed=v)
        engine.load_weights(items)
        scores[v] = engine.score(seqs, start)
        engine.load_weights(as_published(items))  # as a subscriber hands out the learner's packed version
        assert engine.score(seqs, start) == scores[v]
        want = hf_scores(model, hf_merged(model, items), seqs, start)
        diff = max(abs(a - b) for r, w in zip(scores[v], want) for a, b in zip(r, w))
        assert diff < TOL, f"v{v}: max |vllm - hf merged| = {diff:.2e}"
    assert scores[1] != base and scores[2] != scores[1]
    gen = engine.generate(prompts, max_new_tokens=4)  # generation runs on the reloaded modules too
    assert all(len(t) >= 1 for t in gen.tokens)
    engine.load_weights(list(hf_merged(model, items).items()))  # version 2 as a full version
    assert engine.score(seqs, start) == scores[2]  # bit-identical weights: identical log-probs
    with pytest.raises(RuntimeError, match="after a full version"):
        engine.load_weights(items)
    engine.load_weights(list(model.named_parameters()))
    assert engine.score(seqs, start) == base
