"""Where a decode step's time goes on the GPU: graph replay time vs the loop, and the kernels of the captured step.

    python3 tools/gpu/hf_fast_profile.py [BATCH=256] [KV=static|paged] [SPANS=256]

SPANS: the attended span(s) of the timed graphs, comma-separated (the rollout_long 1k case attends
128..1152); the kernel profile is of the last span's graph replays (device ms per kernel family and the top
kernels as one JSON line, torch.profiler's table in $OUT/hf_fast_profile_b<B>_span<S>.txt). NO_PROFILE=1
skips it. EXPERTS=grouped_mm (or another transformers name) A/Bs the engine's experts implementation
(default: the engine's auto choice); ATTN=sdpa|flex the static cache's decode attention (default auto: flex on CUDA);
PRESET (default moe-1b) the random model (streamrl.bench.hf_fast.PRESETS: smol-135m is the reasoning recipe's shape).
The first line also counts the host<->device syncs of one generate call (torch's sync debug
mode), next to its decode steps: the loop should sync once per ``sync_every`` steps.
"""
import json
import os
import sys
import warnings

import torch

from streamrl.bench.hf_fast import build_bench_model
from streamrl.engines.hf_fast import FastHFEngine
from streamrl.engines.hf_fast_config import FastHFConfig

B, P = int(sys.argv[1]) if len(sys.argv) > 1 else 256, 128
KV = sys.argv[2] if len(sys.argv) > 2 else "static"  # static | paged
SPANS = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "256").split(",")]
SPAN = SPANS[-1]
MAX_LEN = max(384, max(SPANS))
model = build_bench_model(os.environ.get("PRESET", "moe-1b"), "cuda", "bfloat16")
VOCAB = model.config.vocab_size
eng = FastHFEngine(model, None, FastHFConfig(device="cuda", batch_size=B, max_seq_len=MAX_LEN, eos_token_id=VOCAB,
                   kv_cache=KV, span_bucket=SPAN if SPAN % 16 == 0 else 128,
                   experts_implementation=os.environ.get("EXPERTS", "auto"),
                   decode_attention=os.environ.get("ATTN", "auto")))
ATTN = eng.decode_attention
prompts = torch.randint(3, VOCAB, (B, P)).tolist()
eng.generate(prompts, 8, 1.0)  # captures the graph of the first span
steps0 = eng.decode_steps
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        eng.generate(prompts, 64, 1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
syncs = sum("synchroniz" in str(w.message) for w in caught)
print(f"B={B} kv={KV} attn={ATTN} experts={eng.experts_impl} generate of 64 new tokens: {eng.decode_steps - steps0} decode steps, {syncs} host syncs "
      f"(sync_every={eng.sync_every})")
with torch.inference_mode(), eng._impl():
    for span in SPANS:  # as generate() runs (in grad mode the compile fails)
        if (eng.attended_span(span), False) not in eng.graphs:  # flex: one graph for all spans
            eng.graphs[(eng.attended_span(span), False)] = eng._capture(eng.attended_span(span), False)
    eng.max_new.fill_(256)
    eng.prefill(list(range(B)), prompts, False)
    eng.cache.grow(list(range(B)), [MAX_LEN] * B)  # paged: blocks for every position the steps write
    replay_ms = {}
    for span in SPANS:
        # rows write positions span-24 .. span-1: sdpa attends the span bucket, flex each row's blocks up to there
        eng.pos.fill_(span - 24)
        g = eng.graphs[(eng.attended_span(span), False)]
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        replay_ms[span] = e0.elapsed_time(e1) / 20
        print(f"B={B} kv={KV} attn={ATTN} span={span} graph replay: {replay_ms[span]:.3f} ms/step")
    if os.environ.get("NO_PROFILE"):
        sys.exit(0)
    # The captured step as generate() runs it (compiled kernels inside the graph), per kernel family
    # and its top 25 kernels; the table goes to $OUT. If the profiler sees no kernels inside graph
    # replays, the eager step is profiled instead (a different, uncompiled kernel mix: say so).
    from streamrl.bench.learner_step import profile_breakdown

    out = os.environ.get("OUT", ".")
    cuda = torch.device("cuda")
    eng.pos.fill_(SPAN - 24)  # the 10 profiled steps write inside the span as well
    res = profile_breakdown(eng.graphs[(eng.attended_span(SPAN), False)].replay, 10, cuda, torch.cuda.synchronize,
                            table_path=f"{out}/hf_fast_profile_b{B}_span{SPAN}_{eng.experts_impl}_{ATTN}.txt", top=25)
    res["what"] = "graph replay"
    if res["device_ms_per_step"] < 0.5 * replay_ms[SPAN]:
        res = profile_breakdown(lambda: eng._decode(SPAN, False), 3, cuda, torch.cuda.synchronize,
                                table_path=f"{out}/hf_fast_profile_b{B}_span{SPAN}_eager.txt", top=25)
        res["what"] = "eager step (no kernels seen inside graph replays)"
print(json.dumps({"batch": B, "kv": KV, "attn": ATTN, "experts": eng.experts_impl, "attn_span": SPAN, "replay_ms": replay_ms[SPAN], **res}))
