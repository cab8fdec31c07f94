"""LoRA checkpoints hold the adapters and their optimizer state only; resume is bit-exact; the
merged export is base + adapters; ``--adapter`` writes a folder PEFT loads."""
from __future__ import annotations

import json

import torch
import torch.distributed.checkpoint as dcp
from peft import PeftModel
from transformers import AutoModelForCausalLM

from streamrl.export import export_checkpoint, main as export_main, write_hf_folder
from streamrl.learner.run_checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from streamrl.learner.trainer import Trainer
from streamrl.models.factory import build_model

from test_checkpoint import make_batch
from test_lora_trainer import PROBE, lora_cfg

from test_lora_weights import expected_engine_weights


def _train(cfg, steps, ck, save_at=None, resume=False):
    """Train ``steps`` steps (from the latest checkpoint when ``resume``); returns (losses, trainer)."""
    tr = Trainer(cfg)
    start = load_checkpoint(latest_checkpoint(ck), tr)[0]["step"] if resume else 0
    losses = []
    for s in range(start, steps):
        noise = float(torch.rand(()))  # RNG draws between steps: resume must restore the streams
        m = tr.step(make_batch(100 + s))
        losses.append((m["learner/loss"], m["learner/grad_norm"], noise))
        if save_at is not None and s + 1 == save_at:
            save_checkpoint(ck, s + 1, tr, {"version": s + 1})
            return losses, None
    return losses, tr


def test_lora_checkpoint_is_adapters_only_and_resume_is_bit_exact(tmp_path):
    cfg = lora_cfg(f"run.run_dir={tmp_path}")
    torch.manual_seed(0)
    full_losses, full = _train(cfg, 4, tmp_path / "a")
    torch.manual_seed(0)
    first, _ = _train(cfg, 4, tmp_path / "ck", save_at=2)
    keys = dcp.FileSystemReader(str(latest_checkpoint(tmp_path / "ck"))).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("model.")]
    assert weights and all(".lora_" in k for k in weights)  # no base tensor in the checkpoint
    assert all(".lora_" in k for k in keys if k.startswith("optim."))
    torch.manual_seed(123)
    resumed_losses, resumed = _train(cfg, 4, tmp_path / "ck", resume=True)
    assert first + resumed_losses == full_losses  # exact float equality
    for (n, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), n


def test_merged_export_and_adapter_folder(tmp_path):
    cfg = lora_cfg(f"run.run_dir={tmp_path}")
    tr = Trainer(cfg)
    for s in range(2):
        tr.step(make_batch(100 + s))
    ck = save_checkpoint(tmp_path / "ck", 2, tr, {"version": 2})
    want = expected_engine_weights(cfg, tr)  # base + scaling * B @ A, the engines' bits

    info = export_checkpoint(ck, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    got = dict(merged.named_parameters())
    assert info["tensors"] == len(want) and sorted(got) == sorted(want)
    for n, t in want.items():
        assert torch.equal(got[n], t), n
    live = write_hf_folder(tr, tmp_path / "live")  # the in-run folder: same bits
    for n, p in AutoModelForCausalLM.from_pretrained(live).named_parameters():
        assert torch.equal(p, want[n]), n

    assert export_main(["--run-dir", str(tmp_path), "--checkpoint", str(ck), "--out", str(tmp_path / "ad"),
                        "--adapter"]) == 0
    assert json.loads((tmp_path / "ad" / "adapter_config.json").read_text())["r"] == cfg.model.lora.r
    base, _ = build_model(cfg.model, seed=cfg.run.seed)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "ad"))
    with torch.no_grad():
        a = peft_model(input_ids=PROBE).logits
        b = merged(input_ids=PROBE).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=0)  # unmerged PEFT == merged export
    merged_by_peft = dict(peft_model.merge_and_unload().named_parameters())
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(merged_by_peft[name], got[name], atol=1e-6, rtol=0)
    assert not torch.equal(got[name], dict(build_model(cfg.model, seed=cfg.run.seed)[0].named_parameters())[name])
