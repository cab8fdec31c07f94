"""Which Hugging Face MoE families the learner converts, exactly, and which it refuses.

The learner swaps each HF sparse-MoE block for :class:`~streamrl.models.moe.EPMoEBlock`
(expert parallel, routing replay). That is only sound when the new block computes the same
function as the HF block, so every family is declared here with the routing it uses; a family
that is not declared, or a declared one with an option the block does not reproduce, is refused
at start with one line (:class:`ConfigError`) instead of being trained as something else.

Support matrix (transformers 5.19; each exact row has a per-family test with a tiny random
config, ``tests/test_moe_families.py``):

=================  =======  ===========================================================
family             status   routing / extras reproduced
=================  =======  ===========================================================
qwen3_moe          exact    softmax top-k, ``norm_topk_prob``
qwen2_moe          exact    softmax top-k, ``norm_topk_prob``, shared expert + sigmoid gate
mixtral            exact    softmax top-k, renormalised; refused if ``router_jitter_noise > 0``
olmoe              exact    softmax top-k, ``norm_topk_prob``
deepseek_v3        exact    sigmoid scores + ``e_score_correction_bias`` for the choice,
                            group-limited top-k (top-2 sum per group), ``norm_topk_prob``,
                            ``routed_scaling_factor``, shared experts, fp32 router
deepseek_v2        exact    softmax (fp32), ``greedy`` or ``group_limited_greedy`` (max per
                            group), ``routed_scaling_factor``, shared experts
gpt_oss            refused  router bias, expert biases, clamped SwiGLU (alpha, limit)
any other MoE      refused  (named in the error)
=================  =======  ===========================================================
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from streamrl.errors import ConfigError


@dataclass(frozen=True)
class RoutingSpec:
    """How a family's router turns router logits ``[N, E]`` into top-k weights and expert ids.

    ``score``: ``softmax`` or ``sigmoid`` of the logits. ``choice_bias``: add the router's
    ``e_score_correction_bias`` [E] to the scores when choosing (not to the weights).
    ``n_group``/``topk_group``: keep only the ``topk_group`` best of ``n_group`` expert groups,
    a group scored by ``group_score`` (``top2_sum`` or ``max``). The weights are the chosen
    scores, renormalised when ``norm_topk_prob``, times ``scaling``. ``fp32_logits``: the router
    matmul runs in float32 whatever the parameter dtype.
    """

    top_k: int
    norm_topk_prob: bool = True
    score: str = "softmax"
    choice_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    scaling: float = 1.0
    fp32_logits: bool = False


@dataclass(frozen=True)
class MoEFamily:
    """A supported family: its routing and the name of its shared-expert module(s), if any."""

    name: str
    routing: RoutingSpec
    shared: tuple[str, ...] = ()  # attribute names kept from the HF block (parameter names stay)


# Config attributes that mark a model as a mixture of experts, whatever its family.
_EXPERT_COUNT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_SUPPORTED = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "deepseek_v2")


def is_moe_config(cfg) -> bool:
    """True when an HF config describes routed experts."""
    return any(int(getattr(cfg, a, 0) or 0) > 0 for a in _EXPERT_COUNT_ATTRS)


def _refuse(family: str, what: str) -> ConfigError:
    return ConfigError(f"model family {family!r}: {what}; StreamRL converts MoE blocks exactly or not at all "
                       f"(supported: {', '.join(_SUPPORTED)})")


def moe_family(cfg) -> MoEFamily | None:
    """The :class:`MoEFamily` of an HF config, None for a dense model, or :class:`ConfigError`
    naming the family and what is not supported."""
    family = str(getattr(cfg, "model_type", "?"))
    if not is_moe_config(cfg):
        return None
    k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
    if family in ("qwen3_moe", "olmoe"):
        return MoEFamily(family, RoutingSpec(k, bool(cfg.norm_topk_prob)))
    if family == "qwen2_moe":
        return MoEFamily(family, RoutingSpec(k, bool(cfg.norm_topk_prob)), ("shared_expert", "shared_expert_gate"))
    if family == "mixtral":
        if float(getattr(cfg, "router_jitter_noise", 0.0) or 0.0) > 0:
            raise _refuse(family, f"router_jitter_noise = {cfg.router_jitter_noise} (random training-time "
                                  "input scaling) is not supported; set it to 0")
        return MoEFamily(family, RoutingSpec(k, True))
    if family == "deepseek_v3":
        routing = RoutingSpec(k, bool(cfg.norm_topk_prob), "sigmoid", True, int(cfg.n_group or 1),
                              int(cfg.topk_group or 1), "top2_sum", float(cfg.routed_scaling_factor), True)
        return MoEFamily(family, _check_groups(family, routing, cfg), ("shared_experts",))
    if family == "deepseek_v2":
        method = getattr(cfg, "topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise _refuse(family, f"topk_method = {method!r} is not supported (greedy, group_limited_greedy)")
        grouped = method == "group_limited_greedy"
        routing = RoutingSpec(k, False, "softmax", False, int(cfg.n_group or 1) if grouped else 1,
                              int(cfg.topk_group or 1) if grouped else 1, "max", float(cfg.routed_scaling_factor), True)
        return MoEFamily(family, _check_groups(family, routing, cfg), ("shared_experts",))
    if family == "gpt_oss":
        raise _refuse(family, "router bias, expert biases and the clamped SwiGLU (swiglu_alpha, swiglu_limit) "
                              "are not supported")
    raise _refuse(family, "this MoE family is not in the support matrix")


def _check_groups(family: str, r: RoutingSpec, cfg) -> RoutingSpec:
    e = next(int(getattr(cfg, a)) for a in _EXPERT_COUNT_ATTRS if int(getattr(cfg, a, 0) or 0) > 0)
    if e % r.n_group or not 1 <= r.topk_group <= r.n_group or r.topk_group * (e // r.n_group) < r.top_k:
        raise _refuse(family, f"n_group = {r.n_group}, topk_group = {r.topk_group} do not fit {e} experts "
                              f"and top-{r.top_k}")
    return r


def probe_ids(vocab_size: int, n: int = 16, seed: int = 0):
    """[1, n] fixed pseudo-random token ids for :func:`check_converted_logits`."""
    g = torch.Generator().manual_seed(seed)
    # device="cpu" with the CPU generator: a model built under a CUDA default device (torch.device
    # context) would otherwise draw on the GPU with a CPU generator, which torch refuses
    return torch.randint(0, vocab_size, (1, n), generator=g, device="cpu")


def check_converted_logits(reference, converted_model, input_ids, atol: float | None = None) -> float:
    """Fail at start when the converted model's logits differ from the HF model's.

    Args:
        reference: the unconverted HF model, or its logits [B, T, V] on ``input_ids`` (take
            them before converting in place: ``reference_logits(model, ids)``).
        converted_model: the model after :func:`~streamrl.models.moe.convert_moe_blocks` (and
            sharding; then every rank must call, the forward is collective).
        input_ids: [B, T] tokens, e.g. :func:`probe_ids`.
        atol: allowed max |difference|; default 1e-3 x max |logit| in float32, 5e-2 x in bf16/fp16
            (the converted block sums experts in another order than the HF loop).
    Returns:
        The max absolute logit difference. Raises :class:`ConfigError` (one line) above ``atol``.
    """
    ref = reference if isinstance(reference, torch.Tensor) else reference_logits(reference, input_ids)
    got = reference_logits(converted_model, input_ids.to(_device_of(converted_model)))
    ref = ref.float().to(got.device)
    if atol is None:
        dtype = next(converted_model.parameters()).dtype
        atol = (1e-3 if dtype == torch.float32 else 5e-2) * max(1.0, float(ref.abs().max()))
    diff = float((got - ref).abs().max())
    if not diff <= atol:
        family = getattr(getattr(converted_model, "config", None), "model_type", "?")
        raise ConfigError(f"model family {family!r}: the converted MoE model's logits differ from the HF model's "
                          f"by {diff:.3g} (> {atol:.3g}) on {input_ids.numel()} probe tokens; not training it")
    return diff


def reference_logits(model, input_ids):
    """[B, T, V] float32 logits of ``model`` in eval mode (its mode is restored)."""
    was_training = model.training
    model.eval()
    input_ids = input_ids.to(_device_of(model))
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
    finally:
        model.train(was_training)
    return out.logits.float()


def _device_of(model):
    p = next(model.parameters())
    return p.device if not hasattr(p, "to_local") else p.to_local().device
