"""Where a decode step's time goes on the GPU: graph replay time vs the loop, eager kernel profile."""
import sys

import torch

from streamrl.bench.hf_fast import build_bench_model
from streamrl.engines.hf_fast import FastHFEngine

B, P, SPAN = int(sys.argv[1]) if len(sys.argv) > 1 else 256, 128, 256
KV = sys.argv[2] if len(sys.argv) > 2 else "static"  # static | paged
model = build_bench_model("moe-1b", "cuda", "bfloat16")
eng = FastHFEngine(model, None, device="cuda", batch_size=B, max_seq_len=384, eos_token_id=32768,
                   kv_cache=KV)
prompts = torch.randint(3, 32768, (B, P)).tolist()
eng.generate(prompts, 8, 1.0)  # captures span 256
with torch.no_grad(), eng._impl():
    eng.max_new.fill_(256)
    eng._prefill(list(range(B)), prompts, False)
    eng.cache.grow(list(range(B)), [SPAN] * B)  # paged: blocks for every position the steps write
    g = eng.graphs[(SPAN, False)]
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(20):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    print(f"B={B} kv={KV} graph replay: {e0.elapsed_time(e1) / 20:.3f} ms/step")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            eng._decode(SPAN, False)
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
