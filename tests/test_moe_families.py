"""The MoE support matrix: every declared family converts exactly (logits and gradients of tiny
random models, CPU, ep = 1, DeepSeek-V3 also at ep = 2); the others are refused in one line."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as T

from streamrl.config import ConfigError
from streamrl.models.families import check_converted_logits, moe_family, probe_ids, reference_logits
from streamrl.models.moe import convert_moe_blocks

from tests.dist_helpers import spawn_gloo

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=32, max_position_embeddings=64, tie_word_embeddings=False)
# MLA attention (one kv head per query head, as DeepSeek's own configs have)
_MLA = dict(q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32)
_DS = {**{k: v for k, v in COMMON.items() if k != "head_dim"}, "num_key_value_heads": 2, **_MLA}


def _config(family: str):
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=False)
    if family == "qwen2_moe":
        return T.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, intermediate_size=48, norm_topk_prob=False)
    if family == "mixtral":
        return T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    if family == "olmoe":
        return T.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=True)
    if family == "deepseek_v3":  # layer 0 dense; 8 experts in 4 groups, top-2 of the best 2 groups
        return T.DeepseekV3Config(**_DS,
                                  n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                  moe_intermediate_size=32, intermediate_size=48, n_shared_experts=1,
                                  first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True)
    if family == "deepseek_v2":
        return T.DeepseekV2Config(**_DS,
                                  n_routed_experts=8, num_experts_per_tok=2, topk_method="group_limited_greedy",
                                  n_group=4, topk_group=2, moe_intermediate_size=32, intermediate_size=48,
                                  n_shared_experts=2, first_k_dense_replace=0, routed_scaling_factor=1.5)
    raise KeyError(family)


def _model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
    with torch.no_grad():  # spread the routers and bias the choice so every code path matters
        for name, t in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                t.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


EXACT = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "deepseek_v2"]


@pytest.mark.parametrize("family", EXACT)
def test_converted_model_equals_hf_model(family):
    hf = _model(family)
    ours = copy.deepcopy(hf)
    blocks = convert_moe_blocks(ours)
    assert blocks and moe_family(hf.config).name == family
    assert dict(hf.named_parameters()).keys() == dict(ours.named_parameters()).keys()  # HF names kept
    ids = probe_ids(hf.config.vocab_size, 24)
    ref = reference_logits(hf, ids)
    assert check_converted_logits(ref, ours, ids, atol=1e-5) <= 1e-5
    # train mode (HF top-k, no jitter) and gradients: the same function, the same update
    hf.train(), ours.train()
    loss_hf = hf(input_ids=ids, labels=ids).loss
    loss = ours(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, loss_hf, atol=1e-6, rtol=1e-6)
    loss_hf.backward(), loss.backward()
    grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_deepseek_v3_uses_sigmoid_bias_groups_and_shared_experts():
    """The block the issue caught: dropping any DeepSeek piece moves the logits past the check."""
    hf = _model("deepseek_v3")
    ids = probe_ids(hf.config.vocab_size, 24)
    ref = reference_logits(hf, ids)
    for broken in ("score", "shared", "bias", "groups"):
        ours = copy.deepcopy(hf)
        blk = convert_moe_blocks(ours)[0]
        if broken == "score":
            blk.routing = type(blk.routing)(**{**blk.routing.__dict__, "score": "softmax"})
        elif broken == "shared":
            blk.shared = ()
        elif broken == "bias":
            blk.routing = type(blk.routing)(**{**blk.routing.__dict__, "choice_bias": False})
        else:
            blk.routing = type(blk.routing)(**{**blk.routing.__dict__, "n_group": 1})
        with pytest.raises(ConfigError, match="'deepseek_v3': the converted MoE model's logits differ"):
            check_converted_logits(ref, ours, ids, atol=1e-5)


def test_unsupported_families_are_refused_in_one_line():
    gpt = T.GptOssConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    jitter = T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1)
    other = T.Glm4MoeConfig(**COMMON, n_routed_experts=4, num_experts_per_tok=2)
    v2 = _config("deepseek_v2")
    v2.topk_method = "noaux_tc"
    for cfg, what in ((gpt, "'gpt_oss': router bias"), (jitter, "'mixtral': router_jitter_noise = 0.1"),
                      (other, "'glm4_moe': this MoE family is not in the support matrix"),
                      (v2, "'deepseek_v2': topk_method = 'noaux_tc'")):
        with pytest.raises(ConfigError, match=what) as e:
            moe_family(cfg)
        assert "\n" not in str(e.value)
    assert moe_family(T.LlamaConfig(**COMMON)) is None  # dense: nothing to convert
    model = T.AutoModelForCausalLM.from_config(gpt)
    with pytest.raises(ConfigError, match="gpt_oss"):
        convert_moe_blocks(model)


def _ep2_logits(rank, world):
    import torch.distributed as dist

    model = _model("deepseek_v3")
    convert_moe_blocks(model, rank, world, dist.new_group(list(range(world))))
    ids = probe_ids(model.config.vocab_size, 24)
    return reference_logits(model, ids[:, rank * 12:(rank + 1) * 12])  # each rank its own tokens


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deepseek_v3_ep2_equals_hf():
    hf = _model("deepseek_v3")
    ids = probe_ids(hf.config.vocab_size, 24)
    out = spawn_gloo(_ep2_logits, 2, timeout_s=240)
    for r, got in enumerate(out):
        torch.testing.assert_close(got, reference_logits(hf, ids[:, r * 12:(r + 1) * 12]), atol=1e-5, rtol=0)


def test_deepseek_v3_trains_checkpoints_and_exports(tmp_path):
    """A declared family end to end: learner steps, DCP checkpoint, streamrl-export, HF logits."""
    from test_export import _hf_logits, _train_save

    from streamrl.export import main
    from streamrl.models.tokenizer import build_char_tokenizer

    src = tmp_path / "src"
    _model("deepseek_v3").save_pretrained(src)
    build_char_tokenizer().save_pretrained(src)
    ref = _train_save(0, 1, str(tmp_path), [f"model.path={src}"])
    assert main(["--run-dir", str(tmp_path), "--out", str(tmp_path / "export")]) == 0
    torch.testing.assert_close(_hf_logits(tmp_path / "export"), ref, atol=1e-5, rtol=0)


def test_parallelize_refuses_an_unsupported_family_before_sharding():
    from streamrl.parallel.expert_parallel import parallelize
    from streamrl.parallel.mesh import build_mesh

    model = T.AutoModelForCausalLM.from_config(
        T.GptOssConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32))
    with pytest.raises(ConfigError, match="'gpt_oss'"):
        parallelize(model, build_mesh(), torch.device("cpu"))
