"""Which Hugging Face MoE families the learner trains: the check ``model.path`` goes through at start.

Run it: ``python docs/examples/my_model.py``.
"""
from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig

from streamrl.config import ConfigError
from streamrl.models.families import moe_family

tiny = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)

if __name__ == "__main__":
    for hf_config in (Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **tiny),
                      MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **tiny),
                      GptOssConfig(num_local_experts=4, num_experts_per_tok=2, **tiny)):
        try:
            family = moe_family(hf_config)
            print(f"{hf_config.model_type}: trained exactly, top-{family.routing.top_k} {family.routing.score}")
        except ConfigError as e:
            print(f"{hf_config.model_type}: refused: {e}")
