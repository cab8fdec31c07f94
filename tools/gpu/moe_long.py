"""A random-weight HF folder of the 0.5 B Qwen3-MoE (configs/gpu-moe.yaml's shape) with the SmolLM2
tokenizer (49,152 tokens), for configs/gpu-long.yaml:

    python3 tools/gpu/moe_long.py /tmp/moe-long

Why not the built-in model: its character tokenizer has ~100 tokens, so random weights draw EOS
about every hundred tokens and "1,024-token" responses average ~100 tokens. With a
49k vocabulary a random model draws EOS once in ~49k tokens: responses run to the cap, as long
reasoning rollouts do.
"""
import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3MoeForCausalLM

from streamrl.config import load_config
from streamrl.models.factory import tiny_moe_config

REPO = Path(__file__).resolve().parents[2]

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("out")
p.add_argument("--shape", default=str(REPO / "configs/gpu-moe.yaml"), help="config whose model section gives the shape")
p.add_argument("--tokenizer", default=str(REPO / "tools/gpu/smol_shape"), help="folder with the tokenizer files")
p.add_argument("--max-positions", type=int, default=4096)
args = p.parse_args()

shape = load_config(args.shape, [f"model.max_positions={args.max_positions}"]).model
tok = AutoTokenizer.from_pretrained(args.tokenizer)
hf_cfg = tiny_moe_config(shape, len(tok), tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                         tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id, tok.eos_token_id)
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(hf_cfg).to(torch.bfloat16)
model.save_pretrained(args.out)
tok.save_pretrained(args.out)
for extra in ("chat_template.jinja",):
    if (Path(args.tokenizer) / extra).exists():
        shutil.copy(Path(args.tokenizer) / extra, args.out)
print(f"random MoE folder {args.out}: {sum(t.numel() for t in model.parameters()) / 1e6:.0f} M parameters, "
      f"vocab {len(tok)}")
