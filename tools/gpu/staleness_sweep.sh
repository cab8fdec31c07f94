#!/usr/bin/env bash
# Staleness sweep on the GPU: the race's StreamRL side (configs/gpu-reasoning.yaml: SmolLM2-135M-Instruct,
# answers up to 1,024 tokens, learner and one hf_fast worker on cuda:0) under one admission setting:
# SETTING = fixed1 | fixed2 | fixed4 | fixed8 | adaptive (tools/gpu/staleness_sweep.py lists the overrides),
# REP = the repeat's number, BUDGET = training seconds (240: with start-up and the scoring of five
# checkpoints one run fits a 10-minute device call). Run on the device machine from the repo root, with
# .whl and .redis carried (tools/gpu/env.sh) and, on a fresh machine, .smolB after tools/gpu/smol_stage.sh:
#   SETTING=fixed2 REP=0 bash tools/gpu/staleness_sweep.sh            (one call per setting and repeat)
# Outputs: $OUT/sweep/$SETTING-r$REP/{streamrl.json, metrics.jsonl, launch.log}. Gather the folders of
# every call under one directory here, then:
#   python tools/gpu/staleness_sweep.py combine DIR --json            (time-to-accuracy per setting)
# Extra arguments are config overrides for the run (after the setting's own).
set -uo pipefail
source tools/gpu/env.sh || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
CONFIG=${CONFIG:-configs/gpu-reasoning.yaml}
SETTING=${SETTING:?set SETTING to fixed1, fixed2, fixed4, fixed8 or adaptive}
REP=${REP:-0}
BUDGET=${BUDGET:-240}
OVERRIDES=$(python3 tools/gpu/staleness_sweep.py overrides "$SETTING") || exit 2
if [[ ! -f models/smol/config.json ]]; then   # the recipe's model, kept while the machine stays warm
  G=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf  # its GGUF travels in two halves (tools/gpu/smol_stage.sh)
  [[ -f $G ]] || { cat /tmp/smol/part00 .smolB/part > "$G"; } 2>/dev/null \
    || { rm -f "$G"; echo "no SmolLM2 GGUF: tools/gpu/smol_stage.sh (.smolA) first, then this with .smolB"; exit 1; }
  python3 -m streamrl.models.prepare --gguf "$G" --out models/smol --experts 0 > "$OUT/prepare.log" 2>&1 \
    || { tail -20 "$OUT/prepare.log"; exit 1; }
fi
RUN=/tmp/sweep/$SETTING-r$REP; DEST=$OUT/sweep/$SETTING-r$REP
rm -rf "$RUN"; mkdir -p "$RUN" "$DEST"
# shellcheck disable=SC2086  # the setting's overrides are separate words
timeout ${SWEEP_TIMEOUT:-570} python3 -m streamrl.bench.cli race --config "$CONFIG" --side streamrl \
  --budget-s "$BUDGET" --out "$RUN" $OVERRIDES "$@" > "$RUN/race.log" 2>&1
rc=$?
cp "$RUN/streamrl.json" "$DEST/" 2>/dev/null
cp "$RUN/streamrl-run/metrics.jsonl" "$DEST/" 2>/dev/null
{ tail -20 "$RUN/race.log"; echo ...; tail -40 "$RUN/streamrl-launch.log"; } > "$DEST/launch.log" 2>/dev/null
tail -5 "$RUN/race.log"
[[ -f $DEST/streamrl.json ]] && python3 tools/gpu/staleness_sweep.py combine "$OUT/sweep" 2>&1 | tail -8
exit $rc
