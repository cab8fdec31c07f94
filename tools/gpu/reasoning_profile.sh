#!/usr/bin/env bash
# Where a learner step of configs/gpu-reasoning.yaml goes (~11 s a step in the race on the H200).
# One device call (< 5 min, fresh machine, cold inductor cache), carry [.whl, .redis] as the other scripts:
#   bash tools/gpu/reasoning_profile.sh
# 1. tools/gpu/reasoning_profile.py on a random SmolLM2-shaped folder (tools/gpu/smol_shape/make.py), fp32 and
#    bf16: one worker batch of the recipe's engine (16 x 8 slots, 1,024-token cap, lengths as in the race:
#    ~8.5 % cut at the cap, the rest ~72 tokens) with and without its truncated tail, and one learner step of
#    64 samples (forward/backward vs optimizer, publish copies). -> $OUT/reasoning_profile.json
# 2. The loop itself: streamrl-launch of the recipe (learner + 1 hf_fast worker on cuda:0, eval off as in the
#    race) on that random folder with the arithmetic task (no reasoning-gym on a fresh device). Random weights
#    rarely draw EOS, so every response runs to 1,024 tokens: a worker batch takes as many decode steps as in
#    the race (where one cut sample in 128 already makes it 1,024 steps), the learner trains ~6x the race's
#    response tokens (an upper bound on its compute). Per-step breakdown from metrics.jsonl:
#    wall between steps = learner/idle_s (waiting for data) + learner/step_s (compute_s + publish) + other
#    (bookkeeping, exports). -> $OUT/reasoning-loop-{metrics.jsonl,learner.log,rollout.log}
# Knobs: PARTS (profile parts, "learner,decode"), DTYPES ("float32,bfloat16"), PROFILE_TIMEOUT (150),
# LOOP (1; 0 skips part 2), LOOP_STEPS (12), LOOP_TIMEOUT (130), and extra config overrides as arguments
# (both parts), e.g. rollout.prompts_per_batch=32 learner.max_staleness=8.
set -uo pipefail
source tools/gpu/env.sh || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
[[ -f /tmp/smol/config.json ]] || python3 tools/gpu/smol_shape/make.py tools/gpu/smol_shape /tmp/smol || exit 1
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv,noheader
echo "== part 1: engine batch and learner step (reasoning_profile.py)"
timeout "${PROFILE_TIMEOUT:-150}" python3 tools/gpu/reasoning_profile.py --model /tmp/smol --device cuda \
  --dtypes "${DTYPES:-float32,bfloat16}" --parts "${PARTS:-learner,decode}" --json "$@" \
  > "$OUT/reasoning_profile.json" 2> "$OUT/reasoning_profile.err"
echo "rc $?"; grep -i -E "warn|error" "$OUT/reasoning_profile.err" | grep -v -i "it/s" | tail -5
python3 - "$OUT/reasoning_profile.json" <<'PY'
import json, sys
try:
    r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
except Exception as e:
    sys.exit(f"no profile JSON ({e})")
print("device", r["device"])
for dt in ("float32", "bfloat16"):
    if dt not in r:
        continue
    x, l, d = r[dt], r[dt].get("learner", {}), r[dt].get("decode", {})
    print(f"[{dt}] lengths mean {x['lengths_mean']:.0f} median {x['lengths_median']:.0f} truncated {x['truncated']}")
    if l:
        print(f"  learner: compute {l['compute_s']:.3f} s = fwd/bwd {l['forward_backward_s']:.3f} + optimizer "
              f"{l['optimizer_s']:.3f}; {l['microbatches']} micro-batches, {l['packed_tokens']} packed tokens "
              f"(padded would be {l['padded_tokens']}); publish gather {l['publish_gather_s']:.3f} s, d2h "
              f"{l['publish_d2h_s']:.3f} s of {l['publish_bytes'] / 2**20:.0f} MiB")
    if d:
        print(f"  decode: {d['slots']} slots, warm-up {d['warmup_s']:.1f} s, compiled {d['compiled']}, "
              f"graphs {d['graphs_captured']}, attention {d['decode_attention']}")
        for case in ("mix", "no_tail"):
            c = d[case]
            print(f"    {case:8s} {c['wall_s']:.2f} s, {c['decode_steps']} steps x {c['ms_per_decode_step']:.2f} ms, "
                  f"{c['tokens_per_s']:.0f} tok/s, slot occupancy {100 * c['slot_occupancy']:.0f} %")
    print("  per step (s):", {k: round(v, 3) for k, v in x["per_step_estimate_s"].items()})
PY
[[ ${LOOP:-1} == 1 ]] || exit 0
echo "== part 2: the loop (learner + 1 hf_fast worker on cuda:0, random weights: every response 1,024 tokens)"
python3 - "$@" <<'PY' || exit 1
import sys, yaml
c = yaml.safe_load(open("configs/gpu-reasoning.yaml"))
c["run"].update(run_dir="/tmp/reasoning-run", steps=1000000)
c["model"]["path"] = "/tmp/smol"
c["task"] = {"name": "arithmetic", "num_digits": 2}
c["eval"] = {"interval": 0}
c["rollout"]["rewards"] = "task"
c["learner"]["skip_no_signal"] = False
yaml.safe_dump(c, open("/tmp/reasoning-loop.yaml", "w"))
PY
rm -rf /tmp/reasoning-run
timeout "${LOOP_TIMEOUT:-130}" python3 -m streamrl.launcher.launch --config /tmp/reasoning-loop.yaml --learners 1 \
  --rollers 1 --steps "${LOOP_STEPS:-12}" "$@" 2>&1 | tail -3
cp /tmp/reasoning-run/metrics.jsonl "$OUT/reasoning-loop-metrics.jsonl" 2>/dev/null
tail -30 /tmp/reasoning-run/logs/learner.log > "$OUT/reasoning-loop-learner.log" 2>/dev/null
tail -30 /tmp/reasoning-run/logs/rollout-0.log > "$OUT/reasoning-loop-rollout.log" 2>/dev/null
grep -i -E "warn|compile" /tmp/reasoning-run/logs/rollout-0.log | tail -3
python3 tools/gpu/reasoning_profile.py --loop-metrics /tmp/reasoning-run/metrics.jsonl
