#!/usr/bin/env bash
# Run several GPU jobs of one device call at once, one job per GPU, as many at a time as the machine has GPUs:
#   bash tools/gpu/on_each_gpu.sh "CMD 1" "CMD 2" ...
# Job k (from 0) runs `bash -c "CMD k"` with CUDA_VISIBLE_DEVICES set to its GPU, OUT=$OUT/job<k> and
# RACE_DIR=/tmp/race-job<k> (tools/gpu/race.sh's working folder), its output in $OUT/job<k>/job.log. Each job
# has a whole GPU to itself, so its timings compare with a one-GPU machine's; the host's CPUs are shared.
# Source tools/gpu/env.sh (or run a race.sh staging step) once before: installs are not made concurrently.
# Example, two race pairs on a 4-GPU machine in one call (tools/gpu/race.sh's header has the staging):
#   STAGE=1 bash tools/gpu/race.sh && bash tools/gpu/on_each_gpu.sh \
#     "SIDE=streamrl bash tools/gpu/race.sh run.seed=1" "SIDE=peer bash tools/gpu/race.sh run.seed=1" \
#     "SIDE=streamrl bash tools/gpu/race.sh run.seed=2" "SIDE=peer bash tools/gpu/race.sh run.seed=2"
# Exit status: 0 when every job exited 0, else 1; each job's status is printed and kept in job<k>/rc.
set -uo pipefail
(( $# )) || { echo "usage: on_each_gpu.sh CMD [CMD ...]" >&2; exit 2; }
export OUT=${OUT:-/tmp/out}
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
(( GPUS > 0 )) || { echo "on_each_gpu.sh: no GPU found (nvidia-smi)" >&2; exit 2; }
echo "on_each_gpu.sh: $# jobs on $GPUS GPUs"
jobs_=("$@")
declare -A running=()  # pid -> GPU index
free=()
for ((g = 0; g < GPUS; g++)); do free+=("$g"); done
start_job() {  # job index, GPU index
  local k=$1 g=$2 dir=$OUT/job$1
  mkdir -p "$dir"
  echo "job$k on GPU $g: ${jobs_[$k]}"
  ( export CUDA_VISIBLE_DEVICES=$g OUT=$dir RACE_DIR=/tmp/race-job$k
    bash -c "${jobs_[$k]}" > "$dir/job.log" 2>&1; echo $? > "$dir/rc" ) &
  running[$!]=$g
}
next=0
while (( next < ${#jobs_[@]} || ${#running[@]} )); do
  while (( next < ${#jobs_[@]} && ${#free[@]} )); do
    start_job "$next" "${free[0]}"; free=("${free[@]:1}"); next=$((next + 1))
  done
  wait -n -p done_pid  # one job ended: its GPU takes the next job
  free+=("${running[$done_pid]}"); unset "running[$done_pid]"
done
status=0
for ((k = 0; k < ${#jobs_[@]}; k++)); do
  rc=$(cat "$OUT/job$k/rc" 2>/dev/null || echo "?")
  echo "job$k exit $rc: ${jobs_[$k]}"; [[ $rc == 0 ]] || status=1
done
exit $status
