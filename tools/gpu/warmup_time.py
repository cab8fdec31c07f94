"""Where the learner's warm-up goes (configs/gpu-long.yaml's learner, alone on the GPU).

    python3 tools/gpu/moe_long.py /tmp/moe-long        (once: the model folder)
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind python3 tools/gpu/warmup_time.py [--flex-dynamic] [--compiled-mask] [--profile]
    (twice: cold, warm cache)

Prints one JSON line of seconds: imports, the Trainer's build, the warm-up
(streamrl.learner.warmup), the same warm-up again (the step's compute alone), and two real steps on
batches of other lengths (a recompile shows as a step far above the second warm-up), with the dynamo
graphs compiled; then dynamo's compile-time table. ``--flex-dynamic`` compiles FlexAttention with
``dynamic=True`` (one graph for every length) instead of the default (static for the first length,
then a dynamic recompile at the second). ``--compiled-mask`` builds the block masks with torch's
``create_block_mask(..., _compile=True)`` (torch's compiled mask builder) instead of
:func:`streamrl.learner.attention.packed_block_mask`'s tile ranges. ``--profile`` prints the first
warm-up's 30 most expensive calls (cProfile, cumulative) to stderr.
"""
import dataclasses
import functools
import json
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402 - the import is part of what is timed

from streamrl.config import load_config  # noqa: E402
from streamrl.learner import attention  # noqa: E402
from streamrl.learner.trainer import Trainer  # noqa: E402
from streamrl.learner.warmup import synthetic_batch  # noqa: E402
from streamrl.utils import limit_threads  # noqa: E402

out = {"imports_s": time.perf_counter() - t0, "flex_dynamic": "--flex-dynamic" in sys.argv,
       "compiled_mask": "--compiled-mask" in sys.argv}
if out["compiled_mask"]:
    import streamrl.learner.trainer as trainer_module

    def _compiled_mask(segment_ids, unit_ids):
        from torch.nn.attention.flex_attention import create_block_mask

        n = int(segment_ids.shape[0])

        def visible(b, h, q, k):
            return (k <= q) & (unit_ids[q] == unit_ids[k]) & ((segment_ids[k] < 0) | (segment_ids[q] == segment_ids[k]))
        return create_block_mask(visible, 1, None, n, n, device=segment_ids.device, _compile=True)
    trainer_module.packed_block_mask = _compiled_mask
if out["flex_dynamic"]:
    @functools.cache
    def _dynamic_flex():
        from torch.nn.attention.flex_attention import flex_attention

        return torch.compile(flex_attention, dynamic=True)
    attention._compiled_flex = _dynamic_flex
limit_threads()
cfg = load_config("configs/gpu-long.yaml", [])
t = time.perf_counter()
tr = Trainer(cfg)
torch.cuda.synchronize()
out["trainer_build_s"] = time.perf_counter() - t
for name in ("warm_up_s", "warm_up_again_s"):
    profile = name == "warm_up_s" and "--profile" in sys.argv
    if profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
    t = time.perf_counter()
    tr.warm_up()
    out[name] = time.perf_counter() - t
    if profile:
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
for i, cut in enumerate((37, 211)):  # real steps: responses of other lengths than the warm-up's
    short = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_new_tokens=cfg.rollout.max_new_tokens - cut))
    b = synthetic_batch(short, tr.vocab_size)
    t = time.perf_counter()
    tr.step(b)
    torch.cuda.synchronize()
    out[f"step{i + 1}_s"] = time.perf_counter() - t
from torch._dynamo.utils import compile_times, counters  # noqa: E402

out["unique_graphs"] = counters["stats"]["unique_graphs"]
print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}), flush=True)
print(compile_times(repr="str", aggregate=True), flush=True)
