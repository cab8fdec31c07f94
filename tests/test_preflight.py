"""Preflight: model folders and cached hub ids, input files, reward plug-ins, ep vs world size,
nearest-key suggestions; `streamrl-launch --dry-run` exits 2 with one line per problem."""
from __future__ import annotations

import json
import subprocess

import pytest

from streamrl.config import ConfigError, load_config
from streamrl.launcher import launch
from streamrl.models.resolve import resolve_model_path
from streamrl.preflight import input_fields, preflight


def problems_of(capsys, *argv) -> list[str]:
    """Run the launcher's --dry-run in-process; it must exit 2; one stderr line per problem."""
    assert launch.main([*argv, "--dry-run"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("streamrl-launch: ") for line in lines), lines
    return lines


def fake_hub_cache(root, repo_id: str, files: dict[str, str]):
    """A Hugging Face hub cache laid out as huggingface_hub writes it (refs/main -> snapshot)."""
    folder = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, text in files.items():
        (snap / name).write_text(text)
    return snap


def test_cli_nonexistent_model_path_exits_2_naming_the_field(repo, python):
    proc = subprocess.run([python, "-m", "streamrl.launcher.launch", "--dry-run", "model.path=/nonexistent"],
                          cwd=repo, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "streamrl-launch: config field 'model.path' = '/nonexistent': no such folder"


def test_local_folder_needs_config_json(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert resolve_model_path(str(model)) == model.resolve()
    with pytest.raises(ConfigError, match="model.path.*has no config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a model folder"):
        resolve_model_path(str(tmp_path / "weights.bin"))


def test_hub_id_resolves_from_the_local_cache_only(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    snap = fake_hub_cache(tmp_path, "acme/tiny-moe", {"config.json": json.dumps({"num_experts": 8})})
    assert resolve_model_path("acme/tiny-moe") == snap.resolve()
    with pytest.raises(ConfigError) as e:
        resolve_model_path("Qwen/Qwen3-30B-A3B")
    msg = str(e.value)
    assert "model.path" in msg and "not in the local Hugging Face cache" in msg and "\n" not in msg


def test_hub_id_passes_dry_run_and_ep_is_checked_against_its_experts(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    fake_hub_cache(tmp_path, "acme/tiny-moe", {"config.json": json.dumps({"num_local_experts": 6})})
    assert launch.main(["--dry-run", "--learners", "2", "model.path=acme/tiny-moe", "learner.ep=2"]) == 0
    capsys.readouterr()
    lines = problems_of(capsys, "--learners", "4", "model.path=acme/tiny-moe", "learner.ep=4")
    assert len(lines) == 1 and "learner.ep = 4 must divide the number of experts 6" in lines[0]


def test_every_problem_is_one_line(capsys, tmp_path):
    lines = problems_of(capsys, "--learners", "3", "model.path=/nonexistent", f"data.path={tmp_path}/p.jsonl",
                        "rollout.rewards=task=1,json:no_such_fn,no_such_pkg_xyz.mod:f",
                        "rollout.reward_model=json.decoder:NaN", "learner.ep=2")
    text = "\n".join(lines)
    assert len(lines) == 6, text
    assert "'model.path' = '/nonexistent'" in lines[0]
    assert "'data.path'" in text and "no such file" in text
    assert "'json:no_such_fn': module 'json' has no attribute 'no_such_fn'" in text
    assert "cannot import 'no_such_pkg_xyz.mod' (ModuleNotFoundError" in text
    assert "rollout.reward_model" in text and "not callable" in text
    assert "learner.ep = 2 must be >= 1 and divide the world size 3" in text


def test_input_fields_cover_any_section_by_name(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1=", "answer": "1"}\n')
    cfg = load_config("configs/tiny.yaml", [f"data.path={prompts}", "rollout.rewards=task=1,json:loads"])
    assert ("data.path", str(prompts)) in list(input_fields(cfg))
    assert preflight(cfg, learner_world=2) == []
    assert preflight(load_config("configs/tiny.yaml", ["learner.ep=4"]), learner_world=4) == []  # 4 experts
    assert preflight(load_config("configs/tiny.yaml", ["learner.ep=4"]), learner_world=2) != []


@pytest.mark.parametrize("override,suggestion", [
    ("rollout.max_new_token=3", "did you mean 'rollout.max_new_tokens'?"),
    ("lerner.lr=1", "did you mean 'learner'?"),
    ("learner.lr_rate=1", "did you mean 'learner.lr'?"),
    ("learner.chat_template=1", "did you mean 'rollout.chat_template'?"),
])
def test_unknown_key_suggests_the_nearest(override, suggestion, capsys):
    with pytest.raises(ConfigError, match=suggestion.replace("?", r"\?").replace(".", r"\.")):
        load_config("configs/tiny.yaml", [override])
    (line,) = problems_of(capsys, override)
    assert suggestion in line


def test_wandb_requested_but_not_installed_is_one_line(capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # import wandb -> ImportError
    (line,) = problems_of(capsys, "--wandb")
    assert "'run.wandb' = true: the wandb package is not installed" in line
