"""Sparse upcycling: turn a dense Llama-layout model into a Mixtral-layout MoE.

Every dense MLP is copied into ``E`` identical experts and a router is added. Mixtral's
router takes a softmax over all experts, keeps the top-k and renormalises their weights to
sum to 1, so with identical experts the block computes ``sum_i w_i * mlp(x) = mlp(x)``
whatever the router says: the upcycled model is the dense model, function for function.
Training then breaks the symmetry (the router starts slightly random so tokens already
spread over experts).

Why Mixtral and not Qwen3-MoE: Qwen3 adds per-head q/k RMSNorm to attention, which a Llama
checkpoint does not have and which cannot be set to the identity; Mixtral's attention is
Llama's. Both transformers and vLLM load Mixtral (also with tied embeddings).
"""
from __future__ import annotations

import torch
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedModel

_COPY_CONFIG = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "hidden_act",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters",
    "initializer_range",
)


def mixtral_config_from_dense(dense_cfg, num_experts: int, experts_per_token: int) -> MixtralConfig:
    """A Mixtral config with the dense model's attention/width and ``num_experts`` experts."""
    if num_experts < 1:
        raise ValueError(f"num_experts = {num_experts}: must be >= 1")
    if not 1 <= experts_per_token <= num_experts:
        raise ValueError(f"experts_per_token = {experts_per_token}: must be in [1, {num_experts}]")
    if getattr(dense_cfg, "mlp_bias", False) or getattr(dense_cfg, "attention_bias", False):
        raise ValueError("dense model has biases in attention/MLP; the Mixtral layout has none")
    kw = {k: getattr(dense_cfg, k) for k in _COPY_CONFIG if getattr(dense_cfg, k, None) is not None}
    kw.setdefault("head_dim", dense_cfg.hidden_size // dense_cfg.num_attention_heads)
    return MixtralConfig(
        **kw,
        num_local_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        sliding_window=None,
        output_router_logits=False,
        router_aux_loss_coef=0.0,
    )


@torch.no_grad()
def upcycle_to_mixtral(dense: PreTrainedModel, num_experts: int = 4, experts_per_token: int = 2,
                       router_std: float = 0.02, seed: int = 0) -> MixtralForCausalLM:
    """Upcycle a Llama-layout causal LM into a function-preserving Mixtral MoE.

    Args:
        dense: a model whose layers have ``self_attn.{q,k,v,o}_proj`` and
            ``mlp.{gate,up,down}_proj`` (Llama, SmolLM2, Mistral).
        num_experts: E, experts per layer (copies of the dense MLP).
        experts_per_token: k, the router's top-k.
        router_std: std of the random router init ``[E, H]`` (any value keeps the function,
            since experts are identical and top-k weights are renormalised).
        seed: router init seed.

    Returns:
        A MixtralForCausalLM in the dense model's dtype; fused experts
        ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I].
    """
    cfg = mixtral_config_from_dense(dense.config, num_experts, experts_per_token)
    dtype = next(dense.parameters()).dtype
    with torch.device("meta"):
        moe = MixtralForCausalLM(cfg)
    src = dense.state_dict()
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, p in moe.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len("experts.gate_up_proj")]
            gate_up = torch.cat([src[pre + "gate_proj.weight"], src[pre + "up_proj.weight"]], dim=0)  # [2I, H]
            out[name] = gate_up.unsqueeze(0).expand(num_experts, -1, -1).clone()
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len("experts.down_proj")]
            out[name] = src[pre + "down_proj.weight"].unsqueeze(0).expand(num_experts, -1, -1).clone()
        elif name.endswith("mlp.gate.weight"):
            out[name] = (torch.randn(tuple(p.shape), generator=gen) * router_std).to(dtype)
        elif name in src:
            out[name] = src[name].clone()
        else:
            raise KeyError(f"upcycle: no source for {name} in the dense model")
    moe = moe.to_empty(device="cpu").to(dtype)
    # non-persistent buffers (rotary inv_freq) came from meta as garbage: rebuild them
    moe.model.rotary_emb = type(moe.model.rotary_emb)(config=cfg)
    missing, unexpected = moe.load_state_dict(out, strict=False)
    # tied lm_head is not a separate parameter; any other gap is a layout mismatch
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise KeyError(f"upcycle: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_word_embeddings:
        moe.tie_weights()
    moe.generation_config = dense.generation_config
    return moe.eval()
