"""``streamrl-bench learner`` end to end on a tiny Llama folder: the padded reference and the
learner's default (shared-prompt) step run side by side in their own subprocesses, and the
headline figures are the shared step's, exact against the padded one."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_checkpoint import REPO


def save_tiny_llama(folder, hidden_size: int, head_dim: int):
    """A random 2-layer dense Llama (2 query heads, 1 KV head) with the character tokenizer, saved to ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from streamrl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, tie_word_embeddings=True,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), hidden_size=32, head_dim=16)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_learner_headline_is_the_shared_step(tiny_folder):
    out = subprocess.run([sys.executable, "-m", "streamrl.bench.learner", "--model", str(tiny_folder), "--groups", "3",
                          "--group-size", "4", "--response-len", "5", "--threads", "1", "--budget", "64", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=280, env={**os.environ})
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(res) >= {"padded", "shared", "speedup_vs_padded", "peak_mem_ratio_vs_padded"}
    assert "packed" not in res  # --impl all adds it
    shared = res["shared"]
    assert res["speedup_vs_padded"] == pytest.approx(res["padded"]["step_s"] / shared["step_s"])
    # the shared layout: a 3 x 4 group's prompt once per unit, so fewer micro-batches than rows
    assert 1 < shared["microbatches_per_step"] < 12
    # the host work before the step's first kernel is micro-batch 0's share of all of it
    assert 0 < shared["first_kernel_s"] <= shared["prepare_s"]
    assert res["max_abs_logprob_diff"] < 1e-5 and res["max_abs_grad_diff"] < 1e-6
    assert shared["max_abs_grad"] > 0  # the gradients compared are not all zero
    # every step runs every sample: no zero-advantage sample is left out of the comparison
    assert res["drop_zero_advantage"] is False and shared["dropped_zero_adv_frac"] == 0.0


def test_profile_breakdown_names_the_kernels_no_family_matched(tmp_path):
    import torch

    from streamrl.bench.learner_step import profile_breakdown

    x = torch.randn(64, 64)
    table = tmp_path / "table.txt"
    res = profile_breakdown(lambda: torch.cumsum(torch.tanh(x), 0), 2, torch.device("cpu"), lambda: None,
                            table_path=str(table), top=5)
    assert res["device_ms_per_step"] > 0 and {"other", "index / sort / scatter (dispatch)"} <= res["families_ms"].keys()
    others = [name for name, _ in res["top_other_kernels_ms"]]
    assert "aten::tanh" in others and "aten::cumsum" not in others  # cumsum has its family (dispatch)
    assert "aten::tanh" in table.read_text() and "aten::cumsum" in table.read_text()
