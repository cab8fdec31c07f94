"""Sharded start (model.load = sharded): meta-device build, EP + FSDP2 on meta, per-rank shard
loading from the HF safetensors folder. Every full parameter gathered after loading equals the
HF model's tensor exactly, logits equal, ties and buffers survive, and no rank holds the model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen3MoeConfig

from streamrl.config import ConfigError, ModelConfig
from streamrl.models.factory import load_model_and_tokenizer
from streamrl.models.families import probe_ids, reference_logits
from streamrl.models.moe import convert_moe_blocks
from streamrl.models.sharded_load import has_meta_params
from streamrl.models.tokenizer import build_char_tokenizer
from streamrl.parallel.expert_parallel import full_parameter, parallelize
from streamrl.parallel.mesh import build_mesh
from streamrl.utils import peak_rss_bytes

from tests.dist_helpers import spawn_gloo

SMOL = Path(__file__).resolve().parents[1] / "models" / "smol"
_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)


def _write_model(folder: Path, family: str, seed: int = 0, **over) -> Path:
    """A tiny random HF model of ``family`` saved as safetensors + tokenizer into ``folder``."""
    if family == "llama":
        cfg = LlamaConfig(**{**_COMMON, "tie_word_embeddings": True, **over})
    elif family == "mixtral":
        cfg = MixtralConfig(**{**_COMMON, "num_local_experts": 4, "num_experts_per_tok": 2,
                               "tie_word_embeddings": True, **over})
    else:
        cfg = Qwen3MoeConfig(**{**_COMMON, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                                "tie_word_embeddings": False, **over})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # spread the routers so every expert gets tokens in the logits check
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 1.0)
    model.save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)
    return folder


def _reference(folder: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The HF model's parameters under our names/layout (experts fused, ep = 1), and its logits."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    logits = reference_logits(model, probe_ids(model.config.vocab_size))
    convert_moe_blocks(model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, logits


def _load_sharded(folder: Path, ep: int) -> dict:
    model, _ = load_model_and_tokenizer(ModelConfig(path=str(folder)), defer_weights=True)
    assert has_meta_params(model)
    mesh = build_mesh(ep, "cpu", _num_experts(model.config))
    parallelize(model, mesh, torch.device("cpu"))
    assert not has_meta_params(model)
    return {"params": {n: full_parameter(n, p, mesh) for n, p in model.named_parameters()},
            "logits": reference_logits(model, probe_ids(model.config.vocab_size)),
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "buffers": {n: b.clone() for n, b in model.named_buffers()}}


def _num_experts(cfg) -> int:
    return next((int(getattr(cfg, a)) for a in ("num_local_experts", "num_experts", "n_routed_experts")
                 if getattr(cfg, a, None)), 0)


def _sharded_worker(rank, world, jobs):
    return [_load_sharded(folder, ep) for folder, ep in jobs]


def _check(folder: Path, outs: list[dict]) -> None:
    ref, ref_logits = _reference(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref_buffers = dict(hf.named_buffers())
    for out in outs:
        assert out["params"].keys() == ref.keys()
        for name, t in ref.items():
            assert torch.equal(out["params"][name], t), name  # bit-exact
        assert out["tied"] == bool(hf.config.tie_word_embeddings)
        for name, b in out["buffers"].items():
            assert torch.equal(b, ref_buffers[name]), name
        torch.testing.assert_close(out["logits"], ref_logits, atol=1e-5, rtol=0)


def _write_family(folder: Path, family: str) -> Path:
    """The tiny models of the MoE support matrix (tests/test_moe_families.py), saved."""
    from test_moe_families import _model

    _model(family).save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", ["llama", "mixtral", "deepseek_v3"])
def test_one_rank_in_process(tmp_path, family):
    folder = (_write_model(tmp_path / family, family) if family != "deepseek_v3"
              else _write_family(tmp_path / family, family))
    _check(folder, [_load_sharded(folder, 1)])


def test_two_ranks_dense_and_moe_ep2(tmp_path):
    """One 2-rank run loads: a tied dense Llama whose rows do not split evenly (FSDP pads), a
    Mixtral (per-expert w1/w3/w2 under block_sparse_moe), a Qwen3-MoE and a Qwen2-MoE (shared
    expert) with ep = 2."""
    jobs = [(_write_model(tmp_path / "llama", "llama", hidden_size=96), 1),
            (_write_model(tmp_path / "mixtral", "mixtral"), 2),
            (_write_model(tmp_path / "qwen3_moe", "qwen3_moe"), 2),
            (_write_family(tmp_path / "qwen2_moe", "qwen2_moe"), 2)]
    outs = spawn_gloo(_sharded_worker, 2, jobs, timeout_s=300)
    for i, (folder, _) in enumerate(jobs):
        _check(folder, [o[i] for o in outs])


def test_parameters_attached_with_storage_keep_their_values(tmp_path):
    from streamrl.learner.critic import attach_value_head

    folder = _write_model(tmp_path / "llama", "llama")
    model, _ = load_model_and_tokenizer(ModelConfig(path=str(folder)), defer_weights=True)
    head = attach_value_head(model)
    with torch.no_grad():
        head.proj.weight.fill_(0.5)
        head.proj.bias.fill_(-2.0)
    parallelize(model, build_mesh(), torch.device("cpu"))
    assert torch.equal(head.proj.weight, torch.full_like(head.proj.weight, 0.5))
    assert torch.equal(head.proj.bias, torch.tensor([-2.0]))


def test_full_load_mode_and_random_init_are_unchanged(tmp_path):
    folder = _write_model(tmp_path / "llama", "llama")
    model, _ = load_model_and_tokenizer(ModelConfig(path=str(folder), load="full"), defer_weights=True)
    assert not has_meta_params(model)
    a, _ = load_model_and_tokenizer(ModelConfig(), seed=3, defer_weights=True)
    b, _ = load_model_and_tokenizer(ModelConfig(), seed=3)
    assert not has_meta_params(a)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(ConfigError, match="model.load"):
        ModelConfig(load="lazy").validate("model")


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _write_model(tmp_path / "llama", "llama")
    weights = load_file(folder / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    model, _ = load_model_and_tokenizer(ModelConfig(path=str(folder)), defer_weights=True)
    with pytest.raises(ValueError, match="model.norm.weight"):
        parallelize(model, build_mesh(), torch.device("cpu"))


def _peak_worker(rank, world, folder, load):
    """Peak RSS growth (bytes) of this rank while the learner model is built and sharded."""
    import gc

    before = peak_rss_bytes()
    model, _ = load_model_and_tokenizer(ModelConfig(path=str(folder), load=load), defer_weights=True)
    parallelize(model, build_mesh(1, "cpu", 0), torch.device("cpu"), check_logits=False)
    gc.collect()
    return peak_rss_bytes() - before


@pytest.mark.slow
def test_sharded_start_never_holds_the_whole_model(tmp_path):
    # ~340 MB of fp32 weights: large next to the ~30 MB a rank allocates of its own (with 128 MB
    # that noise alone took a sharded rank to 0.73x the model in CI)
    folder = _write_model(tmp_path / "big", "llama", vocab_size=32768, hidden_size=768, intermediate_size=3072,
                          num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=2, head_dim=64)
    size = (folder / "model.safetensors").stat().st_size
    # Warm the page cache so both runs read the file the same way.
    (folder / "model.safetensors").read_bytes()
    sharded = spawn_gloo(_peak_worker, 2, folder, "sharded")
    full = spawn_gloo(_peak_worker, 2, folder, "full")
    assert max(sharded) < 0.75 * size, (sharded, size)  # half the model + noise; never the whole
    assert min(full) > 0.9 * size, (full, size)


@pytest.mark.slow
@pytest.mark.skipif(not (SMOL / "config.json").is_file(), reason="models/smol not prepared (streamrl-prepare-model)")
def test_smollm2_two_ranks_bit_exact():
    _check(SMOL, [o[0] for o in spawn_gloo(_sharded_worker, 2, [(SMOL, 1)], timeout_s=300)])


def test_trainer_sharded_start_with_value_head_and_reference_model(tmp_path):
    """The learner's own start: a value head attached on the meta model keeps its init, the KL
    reference model (a copy of the meta model) loads the same weights, and a step trains."""
    from test_checkpoint import make_batch

    from streamrl.config import load_config
    from streamrl.learner.critic import value_head
    from streamrl.learner.trainer import Trainer

    folder = _write_model(tmp_path / "llama", "llama")
    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(f"{repo}/configs/tiny.yaml", [f"run.run_dir={tmp_path}", f"model.path={folder}",
                                                    "learner.loss=vtrace", "learner.kl_coef=0.1"])
    torch.manual_seed(0)
    tr = Trainer(cfg)
    ref, _ = _reference(folder)
    for model in (tr.model, tr.ref_model):
        got = dict(model.named_parameters())
        assert all(torch.equal(got[n], t) for n, t in ref.items())
    head = list(value_head(tr.model).parameters())
    assert head and all(torch.equal(p, torch.zeros_like(p)) for p in head)  # its zero init
    metrics = tr.step(make_batch(300))
    assert all(map(lambda v: v == v, metrics.values()))  # no NaN
    assert not all(torch.equal(p, ref[n]) for n, p in tr.model.named_parameters() if n in ref)
