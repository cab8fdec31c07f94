"""Model out: learner checkpoints (any world size / ep, dense or MoE, with a value head) and the
live learner become HF folders whose ``AutoModelForCausalLM`` logits equal the learner's."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from test_checkpoint import make_batch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.config import ConfigError, load_config
from streamrl.export import export_checkpoint, main, write_hf_folder
from streamrl.learner.run_checkpoint import CheckpointError, latest_checkpoint, save_checkpoint
from streamrl.learner.trainer import Trainer

from tests.dist_helpers import spawn_gloo
from tests.model_helpers import tiny_llama_folder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS = torch.tensor([[1, 5, 9, 4, 12, 7, 3, 18], [1, 11, 6, 6, 2, 19, 8, 10]])


def _learner_logits(tr: Trainer) -> torch.Tensor:
    """[B, T, V] logits of the learner's own (sharded, converted) model in eval mode."""
    tr.model.eval()
    with torch.no_grad():
        out = tr.model(input_ids=IDS, attention_mask=torch.ones_like(IDS), use_cache=False).logits
    tr.model.train()
    return out.detach().float()


def _hf_logits(folder: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits.float()


def _assert_plain_hf_folder(folder: Path):
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names, names
    shards = [p for p in folder.iterdir() if p.suffix == ".safetensors"]
    assert shards
    from safetensors import safe_open

    keys = {k for s in shards for k in safe_open(str(s), "pt").keys()}
    assert not any("value_head" in k for k in keys), "the V-trace value head must stay behind"
    AutoTokenizer.from_pretrained(folder)


def _train_save(rank, world, tmp, overrides):
    """Train 2 steps, save a checkpoint, write an in-run HF folder; returns the learner's logits."""
    tmp = Path(tmp)
    torch.manual_seed(0)
    cfg = load_config(f"{REPO}/configs/tiny.yaml", [f"run.run_dir={tmp}", "learner.lr=1e-2", *overrides])
    tr = Trainer(cfg)
    for s in range(2):
        tr.step(make_batch(300 + s))
    save_checkpoint(tmp / "checkpoints", 2, tr, {"version": 2})
    write_hf_folder(tr, tmp / "live_hf")
    return _learner_logits(tr)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_moe_two_ranks_ep2_with_value_head_exports_exactly(tmp_path):
    """The must-hold path: 2 learner ranks, ep = 2, V-trace head on; export in one process."""
    ref = spawn_gloo(_train_save, 2, str(tmp_path), ["learner.ep=2", "learner.loss=vtrace"], timeout_s=240)
    assert torch.equal(ref[0], ref[1])
    out = tmp_path / "export"
    assert main(["--run-dir", str(tmp_path), "--out", str(out)]) == 0
    _assert_plain_hf_folder(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"
    torch.testing.assert_close(_hf_logits(out), ref[0], atol=1e-5, rtol=0)
    _assert_plain_hf_folder(tmp_path / "live_hf")  # write_hf_folder, gathered from the 2 ranks
    torch.testing.assert_close(_hf_logits(tmp_path / "live_hf"), ref[0], atol=1e-5, rtol=0)



def test_dense_llama_export_bf16_and_errors(tmp_path):
    src = tiny_llama_folder(tmp_path / "src")
    ref = _train_save(0, 1, str(tmp_path), [f"model.path={src}"])
    out = tmp_path / "export"
    info = export_checkpoint(latest_checkpoint(tmp_path / "checkpoints"), out)
    assert info["step"] == 2 and info["world"] == 1
    _assert_plain_hf_folder(out)
    torch.testing.assert_close(_hf_logits(out), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(_hf_logits(tmp_path / "live_hf"), ref, atol=1e-5, rtol=0)
    gen = lambda f: {k: v for k, v in json.loads((f / "generation_config.json").read_text()).items()  # noqa: E731
                     if k != "transformers_version"}
    assert gen(out) == gen(src) == gen(tmp_path / "live_hf")  # the source's sampling defaults
    # bf16: half the bytes, logits within bf16 rounding
    assert main(["--run-dir", str(tmp_path), "--out", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    torch.testing.assert_close(_hf_logits(tmp_path / "bf16"), ref, atol=0.1, rtol=0.05)
    assert main(["--run-dir", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert main(["--run-dir", str(tmp_path), "--out", str(out), "--dtype", "int3"]) == 2
    (latest_checkpoint(tmp_path / "checkpoints") / "config.json").unlink()  # an older checkpoint
    with pytest.raises(CheckpointError, match="pass --config"):
        export_checkpoint(latest_checkpoint(tmp_path / "checkpoints"), out)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not os.path.isdir(os.path.join(REPO, "models", "smol")), reason="models/smol not prepared (streamrl-prepare-model)")
def test_smol_dense_export_matches_learner(tmp_path):
    ref = _train_save(0, 1, str(tmp_path), [f"model.path={REPO}/models/smol"])
    out = tmp_path / "export"
    assert main(["--run-dir", str(tmp_path), "--out", str(out)]) == 0
    _assert_plain_hf_folder(out)
    torch.testing.assert_close(_hf_logits(out), ref, atol=1e-4, rtol=0)


def test_in_run_step_folders_keep_the_newest(tmp_path):
    """What ``checkpoint.hf_interval`` / ``save_on_stop`` write: CKPT_DIR/hf/step_N, keep_last of them."""
    from streamrl.export import hf_export_dir, write_step_folder

    cfg = load_config(f"{REPO}/configs/tiny.yaml", [f"run.run_dir={tmp_path}", "checkpoint.keep_last=2",
                                                    "checkpoint.hf_interval=1"])
    tr = Trainer(cfg)
    for step in (1, 2, 3):
        assert write_step_folder(tr, step) == hf_export_dir(cfg, step)
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "hf").iterdir()) == ["step_00000002", "step_00000003"]
    torch.testing.assert_close(_hf_logits(hf_export_dir(cfg, 3)), _learner_logits(tr), atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="'checkpoint.hf_interval' = -1"):
        load_config(f"{REPO}/configs/tiny.yaml", ["checkpoint.hf_interval=-1"])
