"""The rollout worker's first decode call and steady batches on the GPU (configs/gpu-long.yaml's engine).

    python3 tools/gpu/moe_long.py /tmp/moe-long        (once: the model folder)
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache python3 tools/gpu/decode_first_call.py   (twice: cold, then warm cache)

Prints one JSON line of seconds: imports, the first generate call (64 new tokens: compile and CUDA-graph
capture of the decode step, then the tokens), three 256 x 1,024-token batches, the dynamo graphs
compiled; then dynamo's compile-time table (bytecode tracing vs inductor). The README's "decoder layer
compiled once" table comes from it.
"""
import json
import time

t0 = time.perf_counter()
import torch  # noqa: E402 - the import is part of what is timed

from streamrl.config import load_config  # noqa: E402
from streamrl.engines.factory import build_engine  # noqa: E402
from streamrl.models.factory import load_model_and_tokenizer  # noqa: E402
from streamrl.utils import limit_threads  # noqa: E402

out = {"imports_s": time.perf_counter() - t0}
limit_threads()
cfg = load_config("configs/gpu-long.yaml", [])
model, tok = load_model_and_tokenizer(cfg.model, seed=0)
engine = build_engine(cfg, model, tok)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(100, 40000, (50,), generator=g).tolist() for _ in range(32) for _ in range(8)]
for i, new_tokens in enumerate((64, 1024, 1024, 1024)):
    t = time.perf_counter()
    engine.generate(prompts, new_tokens, 1.0)
    torch.cuda.synchronize()
    out[f"gen{new_tokens}_{i}_s"] = time.perf_counter() - t
from torch._dynamo.utils import compile_times, counters  # noqa: E402

out.update(captures=engine.captures, compiled=engine.compiled, unique_graphs=counters["stats"]["unique_graphs"])
print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}), flush=True)
print(compile_times(repr="str", aggregate=True), flush=True)
