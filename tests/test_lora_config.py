"""Bad ``model.lora`` input fails at ``streamrl-launch --dry-run``: exit 2, one line naming the field."""
from __future__ import annotations

import json

import pytest

from streamrl.config import load_config
from streamrl.models.lora import lora_problems

from test_preflight import problems_of

ON = "model.lora.enabled=true"


@pytest.mark.parametrize("override, needle", [
    ("model.lora.r=-1", "config field 'model.lora.r' = -1: must be > 0"),
    ("model.lora.target_modules=[nope]", "'nope' matches no nn.Linear of the qwen3_moe model"),
    ("model.lora.target_modules=[]", "config field 'model.lora.target_modules' = []"),
])
def test_bad_lora_input_exits_2_at_dry_run(capsys, override, needle):
    lines = problems_of(capsys, "--config", "configs/tiny.yaml", ON, override)
    assert len(lines) == 1 and needle in lines[0], lines


def test_refused_family_and_tied_head_from_a_folder(tmp_path):
    (tmp_path / "gpt2").mkdir()
    gpt2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "bos_token_id": 0,
            "eos_token_id": 0}
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(gpt2))
    cfg = load_config(None, [ON, "model.lora.target_modules=[c_attn]"])
    assert "refused" in lora_problems(cfg.model, tmp_path / "gpt2")[0]
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64, "tie_word_embeddings": True}))
    cfg = load_config(None, [ON, "model.lora.target_modules=[q_proj,lm_head]"])
    assert "ties to the input embeddings" in lora_problems(cfg.model, tmp_path / "llama")[0]
    cfg = load_config(None, [ON, "model.lora.target_modules=[q_proj,down_proj]"])
    assert lora_problems(cfg.model, tmp_path / "llama") == []


def test_lora_off_and_r_zero_are_the_same():
    assert not load_config(None, ["model.lora.r=8"]).model.lora.active
    assert not load_config(None, [ON, "model.lora.r=0"]).model.lora.active
    assert load_config(None, [ON]).model.lora.active
