#!/usr/bin/env bash
# A/B of the hf_fast decode step on one GPU: the batch-256 graph replay of the working tree ("new") against the
# same with older versions of some files swapped in ("old"), alternated in one call so both see the same machine.
# OLD is a folder that mirrors the repo's layout with only the files to swap, made here before the call, e.g.
#   mkdir -p ab/old/streamrl/engines && for f in dense_experts hf_fast; do
#     git show 49e06fc:streamrl/engines/$f.py > ab/old/streamrl/engines/$f.py; done
# and carried with the call (carry [.whl, .redis, ab]):
#   OLD=ab/old bash tools/gpu/decode_ab.sh
# ORDER (default "new old new old newp"): the runs; "newp" is a new run that also writes the kernel profile of its
# last span (tools/gpu/hf_fast_profile.py's JSON line and table, in $OUT). SPANS (default 256,1024): the timed
# attended spans. Each run's output is $OUT/decode_ab_<k>_<run>.txt; one summary line per run on stdout.
set -uo pipefail
source tools/gpu/env.sh || exit 1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
OLD=${OLD:?set OLD to a folder of older files, laid out as the repo}
NEW=$(mktemp -d)
(cd "$OLD" && find . -type f) > "$NEW/.files"
while read -r f; do mkdir -p "$NEW/$(dirname "$f")" && cp "$f" "$NEW/$f"; done < "$NEW/.files"
swap_in() { while read -r f; do cp "$1/$f" "$f"; done < "$NEW/.files"; }
trap 'swap_in "$NEW"' EXIT  # the working tree ends as it began
k=0
for run in ${ORDER:-new old new old newp}; do
  k=$((k + 1))
  if [[ $run == old ]]; then swap_in "$OLD"; else swap_in "$NEW"; fi
  no_profile=1; [[ $run == newp ]] && no_profile=
  T0=$(date +%s)
  NO_PROFILE=$no_profile timeout "${RUN_S:-150}" python3 tools/gpu/hf_fast_profile.py 256 static "${SPANS:-256,1024}" \
    > "$OUT/decode_ab_${k}_$run.txt" 2>&1
  rc=$?
  echo "$run (rc $rc, $(( $(date +%s) - T0 )) s): $(grep -o 'span=[0-9]* graph replay: [0-9.]* ms/step' \
    "$OUT/decode_ab_${k}_$run.txt" | sed 's/ graph replay//' | tr '\n' ' ')"
  [[ $rc == 0 ]] || tail -5 "$OUT/decode_ab_${k}_$run.txt"
done
