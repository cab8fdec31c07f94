#!/usr/bin/env bash
# A/B of the hf_fast decode step on one GPU: the graph replay of the working tree ("new") against the same with
# older versions of some files swapped in (one folder per variant), alternated in one call so all see one machine.
# A variant is a folder AB/<name> (AB default: ab) that mirrors the repo's layout with only the files to swap,
# made here before the call, e.g. "old" (before the dense down projection and the fused projections) and "mid"
# (before the fused projections only):
#   mkdir -p ab/old/streamrl/engines ab/mid/streamrl/engines
#   for f in dense_experts hf_fast; do git show 49e06fc:streamrl/engines/$f.py > ab/old/streamrl/engines/$f.py; done
#   git show 587d738:streamrl/engines/hf_fast.py > ab/mid/streamrl/engines/hf_fast.py
# and carried with the call (carry [.whl, .redis, ab]):
#   ORDER="new old mid new old mid newp" bash tools/gpu/decode_ab.sh
#   PRESET=smol-135m BATCH=128 ORDER="new mid new mid newp" bash tools/gpu/decode_ab.sh     # the recipe's shape
# ORDER (default "new old new old newp"): the runs; "new" is the working tree, "newp" a new run that also writes
# the kernel profile of its last span (tools/gpu/hf_fast_profile.py's JSON line and table, in $OUT), any other word
# a variant. SPANS (default 256,1024): the timed attended spans; BATCH (256) the decode slots; PRESET (moe-1b) the
# random model. Each run's output is $OUT/decode_ab_<k>_<run>.txt; one summary line per run on stdout.
set -uo pipefail
source tools/gpu/env.sh || exit 1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
AB=${AB:-ab}
ORDER=${ORDER:-new old new old newp}
NEW=$(mktemp -d)
for run in $ORDER; do  # every file any variant swaps, kept from the working tree to swap back
  [[ $run == new || $run == newp ]] && continue
  [[ -d $AB/$run ]] || { echo "decode_ab.sh: no folder $AB/$run for the variant '$run'"; exit 2; }
  (cd "$AB/$run" && find . -type f) >> "$NEW/.files"
done
sort -u -o "$NEW/.files" "$NEW/.files"
while read -r f; do mkdir -p "$NEW/$(dirname "$f")" && cp "$f" "$NEW/$f"; done < "$NEW/.files"
swap_in() {  # the working tree's files, then the variant's own (a file it lacks stays the working tree's)
  while read -r f; do cp "$NEW/$f" "$f"; done < "$NEW/.files"
  [[ -n ${1:-} ]] && (cd "$AB/$1" && find . -type f) | while read -r f; do cp "$AB/$1/$f" "$f"; done
}
trap 'swap_in' EXIT  # the working tree ends as it began
k=0
for run in $ORDER; do
  k=$((k + 1))
  if [[ $run == new || $run == newp ]]; then swap_in; else swap_in "$run"; fi
  no_profile=1; [[ $run == newp ]] && no_profile=
  T0=$(date +%s)
  NO_PROFILE=$no_profile timeout "${RUN_S:-150}" python3 tools/gpu/hf_fast_profile.py "${BATCH:-256}" static \
    "${SPANS:-256,1024}" > "$OUT/decode_ab_${k}_$run.txt" 2>&1
  rc=$?
  echo "$run (rc $rc, $(( $(date +%s) - T0 )) s): $(grep -o 'span=[0-9]* graph replay: [0-9.]* ms/step' \
    "$OUT/decode_ab_${k}_$run.txt" | sed 's/ graph replay//' | tr '\n' ' ')"
  [[ $rc == 0 ]] || tail -5 "$OUT/decode_ab_${k}_$run.txt"
done
