"""tools/gpu/lora_big.py (the one-GPU LoRA run of a 30 B-shaped MoE) on its tiny CPU shape: the learner trains
the adapters alone, and the adapter version goes through the real publisher and subscriber (real Redis)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_lora_big_tool_runs_on_its_tiny_shape():
    cmd = [sys.executable, str(REPO / "tools" / "gpu" / "lora_big.py"), "--shape", "tiny", "--device", "cpu",
           "--groups", "2", "--prompt-len", "8", "--response-len", "24", "--budget", "128", "--steps", "1",
           "--full-sample-gb", "0.0005", "--json"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0 < res["trainable_params"] < res["total_params"] / 10
    assert res["tokens_per_step"] == 2 * 32 and res["tokens_per_s"] > 0
    lora, full = res["versions"]["lora"], res["versions"]["full_scaled"]
    # a version of the adapters alone: the q/k/v/o A and B of each layer plus the scaling
    assert lora["tensors"] == 2 * 4 * 2 + 1 and lora["bytes"] < full["bytes"]
    # the adapters in float32 (the scaling too) against the frozen base's bytes
    assert lora["bytes"] >= 4 * (res["trainable_params"] + 1) and res["adapter_bytes_ratio"] < 0.1
