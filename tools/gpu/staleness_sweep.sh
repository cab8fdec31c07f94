#!/usr/bin/env bash
# Staleness sweep on the GPU: the race's StreamRL side (tools/gpu/race.sh, configs/gpu-reasoning.yaml:
# SmolLM2-135M-Instruct, answers up to 1,024 tokens, learner and one hf_fast worker on cuda:0) under one
# admission setting: SETTING = fixed1 | fixed2 | fixed4 | fixed8 | adaptive (their config overrides:
# python tools/gpu/staleness_sweep.py overrides SETTING), REP = the repeat's number, BUDGET = training
# seconds (240: with start-up and the scoring of five checkpoints one run fits a 10-minute device call).
# Stage the device first as tools/gpu/race.sh says (its calls 1 and 2), then one call per setting and
# repeat, carrying what race.sh's call 3 carries:
#   SETTING=fixed2 REP=0 bash tools/gpu/staleness_sweep.sh
# A machine with several GPUs runs one setting per GPU in one call (its runs land in $OUT/job<k>/sweep/):
#   STAGE=1 bash tools/gpu/race.sh && bash tools/gpu/on_each_gpu.sh "SETTING=fixed1 REP=0 bash tools/gpu/staleness_sweep.sh" ...
# Outputs: $OUT/sweep/$SETTING-r$REP/{streamrl.json, metrics.jsonl, launch.log}. Gather the folders of
# every call under one directory here, then:
#   python tools/gpu/staleness_sweep.py combine DIR --json            (time-to-accuracy per setting)
# Extra arguments are config overrides for the run (after the setting's own).
set -uo pipefail
SETTING=${SETTING:?set SETTING to fixed1, fixed2, fixed4, fixed8 or adaptive}
REP=${REP:-0}
OVERRIDES=$(python3 tools/gpu/staleness_sweep.py overrides "$SETTING") || exit 2
export OUT=${OUT:-/tmp/out}
DEST=$OUT/sweep/$SETTING-r$REP
mkdir -p "$DEST"
# shellcheck disable=SC2086  # the setting's overrides are separate words
SIDE=streamrl BUDGET=${BUDGET:-240} OUT=$DEST timeout "${SWEEP_TIMEOUT:-570}" bash tools/gpu/race.sh $OVERRIDES "$@"
rc=$?
cp "${RACE_DIR:-/tmp/race}"/streamrl-run/metrics.jsonl "$DEST/" 2>/dev/null
mv "$DEST/streamrl-launch.log" "$DEST/launch.log" 2>/dev/null
rm -f "$DEST/streamrl-exports.json"
[[ -f $DEST/streamrl.json ]] || { echo "staleness_sweep.sh: no streamrl.json for $SETTING-r$REP (rc $rc)"; exit 1; }
grep -o '"learner/staleness_bound": [0-9.]*' "$DEST/metrics.jsonl" | awk '{print $2}' | uniq -c | tr '\n' ' '; echo
exit $rc
