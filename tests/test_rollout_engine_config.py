"""rollout.* engine knobs: validation names the field, and build_engine hands them to the engine."""
from __future__ import annotations

import pytest

from streamrl.config import ConfigError, load_config


@pytest.mark.parametrize("overrides,field", [
    (["rollout.tensor_parallel_size=0"], "rollout.tensor_parallel_size"),
    (["rollout.engine=vllm", "rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size"),  # CPU
    (["rollout.engine=hf_fast", "rollout.device=cuda", "rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size"),
    (["rollout.enforce_eager=false"], "rollout.enforce_eager"),
    (["rollout.engine=vllm", "rollout.enforce_eager=false"], "rollout.enforce_eager"),  # CPU: no graphs
    (["rollout.engine=hf_fast", "rollout.max_new_tokens=600"], "rollout.max_new_tokens"),  # > max_model_len
])
def test_invalid_knobs_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, overrides)


def test_valid_gpu_vllm_knobs():
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.device=cuda", "rollout.enforce_eager=false",
                             "rollout.tensor_parallel_size=2", "rollout.enable_prefix_caching=false"])
    assert (cfg.rollout.enforce_eager, cfg.rollout.tensor_parallel_size) == (False, 2)


@pytest.mark.parametrize("share", [True, False])
def test_hf_fast_gets_cache_length_and_prompt_sharing(share):
    from streamrl.engines.factory import build_engine

    cfg = load_config(None, ["rollout.engine=hf_fast", "rollout.max_model_len=300", "rollout.max_new_tokens=200",
                             f"rollout.enable_prefix_caching={str(share).lower()}"])
    eng = build_engine(cfg)
    try:
        assert (eng.max_len, eng.share_prompts) == (300, share)
        assert eng.batch == cfg.rollout.prompts_per_batch * cfg.rollout.group_size
        gen = eng.generate([[5, 6, 7]] * 2, 200, 1.0)  # 3 + 200 tokens fit the 300-position cache
        assert [len(t) for t in gen.tokens] == [len(lp) for lp in gen.logprobs]
    finally:
        eng.close()
