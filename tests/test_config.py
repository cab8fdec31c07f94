"""Config loading: YAML + overrides, validation errors that name the field and the value."""
from __future__ import annotations

import pytest

from streamrl.config import ConfigError, config_from_dict, load_config


def test_tiny_config_loads(repo):
    cfg = load_config(repo / "configs/tiny.yaml")
    assert cfg.run.name == "tiny"
    assert cfg.task.name == "copy_digits"
    assert cfg.model.hidden_size % 32 == 0


def test_overrides_parse_yaml_scalars(repo):
    cfg = load_config(repo / "configs/tiny.yaml", ["learner.lr=1e-3", "rollout.group_size=4", "run.name=abc"])
    assert cfg.learner.lr == pytest.approx(1e-3)
    assert cfg.rollout.group_size == 4
    assert cfg.run.name == "abc"


def test_roundtrip_through_dict(repo):
    cfg = load_config(repo / "configs/tiny.yaml")
    assert config_from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "override, field, value",
    [
        ("model.hidden_size=48", "model.hidden_size", "48"),
        ("model.head_dim=16", "model.head_dim", "16"),
        ("rollout.group_size=1", "rollout.group_size", "1"),
        ("learner.max_staleness=-1", "learner.max_staleness", "-1"),
        ("task.name=nope", "task.name", "'nope'"),
        ("learner.lr=fast", "learner.lr", "'fast'"),
        ("rollout.group_size=2.5", "rollout.group_size", "2.5"),
        ("model.experts_per_token=9", "model.experts_per_token", "9"),
        ("rollout.paged_attention=fast", "rollout.paged_attention", "'fast'"),
        ("rollout.decode_attention=fast", "rollout.decode_attention", "'fast'"),
        ("rollout.dtype=float16", "rollout.dtype", "'float16'"),
    ],
)
def test_bad_values_name_field_and_value(override, field, value):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert field in msg and value in msg


def test_flex_decode_attention_needs_hf_fast_static_kv():
    load_config(None, ["rollout.engine=hf_fast", "rollout.decode_attention=flex"])
    with pytest.raises(ConfigError, match="rollout.decode_attention.*kv_cache"):
        load_config(None, ["rollout.engine=hf_fast", "rollout.kv_cache=paged", "rollout.decode_attention=flex"])


def test_unknown_field_is_named():
    with pytest.raises(ConfigError, match="learner.lrr"):
        load_config(None, ["learner.lrr=1"])
    with pytest.raises(ConfigError, match="nosection"):
        load_config(None, ["nosection.x=1"])


def test_missing_file_and_bad_override(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["novalue"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_batch_that_admission_control_can_never_admit_is_refused():
    """Workers reserve whole batches: 32 groups never fit one on-policy step of 8 (the run would hang)."""
    with pytest.raises(ConfigError, match=r"rollout.prompts_per_batch.*32.*max_staleness = 0"):
        load_config(None, ["rollout.prompts_per_batch=32", "learner.groups_per_step=8", "learner.max_staleness=0"])
    load_config(None, ["rollout.prompts_per_batch=32", "learner.groups_per_step=8", "learner.max_staleness=4"])
