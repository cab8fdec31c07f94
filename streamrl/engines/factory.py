"""Build the configured generation engine (``rollout.engine``) for a model.

vLLM reads an HF folder, so the tiny random model (``model.path`` empty) is saved once to
a temporary folder first; it is built from the run seed, so it equals the learner's
initial weights exactly.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from streamrl.config import Config
from streamrl.engines.hf import HFEngine
from streamrl.engines.hf_fast import FastHFEngine
from streamrl.engines.hf_fast_config import FastHFConfig
from streamrl.engines.paged_kv import pool_blocks
from streamrl.engines.precision import cast_for_engine, engine_dtype_name
from streamrl.models.factory import build_model, load_model_and_tokenizer, save_model
from streamrl.utils import use_tf32

ENGINES = ("hf", "hf_fast", "vllm")


def model_folder(cfg: Config, model=None, tok=None) -> str:
    """An HF folder holding the configured model (saving the tiny model if needed)."""
    if cfg.model.path:
        return cfg.model.path
    if model is None:
        model, tok = build_model(cfg.model, seed=cfg.run.seed)
    folder = Path(tempfile.mkdtemp(prefix="streamrl-model-"))
    save_model(model, tok, folder)
    return str(folder)


def fast_hf_config(cfg: Config, model) -> FastHFConfig:
    """The hf_fast engine's configuration from ``cfg.rollout``; one slot per sequence of a worker
    batch, so the batch stays full through refills. ``rollout.kv_pool_mb`` sizes the paged pool
    from ``model``'s KV shape."""
    rc = cfg.rollout
    blocks = None
    if rc.kv_cache == "paged" and rc.kv_pool_mb:
        mc = model.config
        blocks = pool_blocks(rc.kv_pool_mb << 20, mc.num_hidden_layers, mc.num_key_value_heads,
                             getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads,
                             next(model.parameters()).element_size(), rc.kv_block_size)
    return FastHFConfig(device=rc.device, batch_size=rc.prompts_per_batch * rc.group_size,
                        max_seq_len=rc.max_model_len, record_routing=rc.record_routing,
                        share_prompts=rc.enable_prefix_caching, kv_cache=rc.kv_cache, block_size=rc.kv_block_size,
                        kv_blocks=blocks, paged_attention=rc.paged_attention, decode_attention=rc.decode_attention)


def build_engine(cfg: Config, model=None, tok=None):
    """The engine named by ``cfg.rollout.engine``.

    ``model``/``tok`` (from :func:`streamrl.models.factory.load_model_and_tokenizer`, in the
    learner's ``model.dtype``) are used by the hf engines, which cast ``model`` in place to
    ``rollout.dtype`` (:mod:`streamrl.engines.precision`), and by ``vllm`` only to save the tiny
    model (vLLM loads the folder in ``rollout.dtype`` itself).
    """
    rc = cfg.rollout
    use_tf32(rc.device)
    if rc.engine in ("hf", "hf_fast"):
        if model is None:
            model, tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
        lora_base = cast_for_engine(model, cfg)
        if rc.engine == "hf":
            return HFEngine(model, tok, rc.device, record_routing=rc.record_routing, lora_base=lora_base)
        return FastHFEngine(model, tok, fast_hf_config(cfg, model), lora_base=lora_base)
    if rc.engine == "vllm":
        from streamrl.engines.vllm_engine import VLLMEngine  # noqa: PLC0415 (vllm is optional and heavy)

        return VLLMEngine(model_folder(cfg, model, tok), dtype=engine_dtype_name(cfg), base_dtype=cfg.model.dtype,
                          kv_cache_bytes=rc.kv_cache_mb << 20, max_model_len=rc.max_model_len,
                          seed=cfg.run.seed, gpu_memory_utilization=rc.gpu_memory_utilization,
                          record_routing=rc.record_routing, enable_prefix_caching=rc.enable_prefix_caching,
                          enforce_eager=rc.enforce_eager, tensor_parallel_size=rc.tensor_parallel_size)
    raise ValueError(f"rollout.engine = {rc.engine!r}: must be one of {ENGINES}")
