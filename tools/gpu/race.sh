#!/usr/bin/env bash
# The time-to-accuracy race on one H200: StreamRL vs TRL's GRPOTrainer on SmolLM2-135M-Instruct,
# think-then-answer reasoning-gym tasks, answers up to 1,024 tokens (configs/gpu-reasoning.yaml).
# One side per device call (each must fit 10 minutes), then combine the two JSONs anywhere:
#   SIDE=streamrl BUDGET=360 bash tools/gpu/race.sh      # -> $OUT/streamrl.json
#   SIDE=peer     BUDGET=360 bash tools/gpu/race.sh      # -> $OUT/peer.json
# A side whose training and scoring do not fit one call (TRL's, at 1,024 tokens) runs as two back-to-back
# calls on the warm machine (its exports wait in /tmp/race):  PHASE=train ...  then  PHASE=score ...
#   streamrl-bench race --combine DIR --json             # DIR holds both: race.json, race.png
#   streamrl-bench race --summarize DIR1 DIR2 DIR3       # the pairs' median and spread (one seed per pair)
# What the device lacks travels in folders excluded from git, at most 64 MiB a call, so staging
# takes three calls (this script looks in the folder and in /tmp/stage, where earlier calls left it):
#   .smolA/.smolB: the two halves of the SmolLM2 GGUF (see tools/gpu/smol_stage.sh);
#   .whl + .redis: ../shared/tools/device-wheels.sh gguf==0.19.0;
#   .whlrg: reasoning-gym, math-verify and their dependencies (py3.12 wheels; pycosat's sdist, built there) and
#   .whlpeer: trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 (the peer's own target): both made by
#     bash tools/gpu/race_wheels.sh (after make setup).
# Each side's JSON records its setup (model bytes, tokenizer, held-out set, releases, GPU); --combine refuses two
# sides whose setups differ, so a pair's sides may run in different calls or sessions but not on different setups.
#   call 1, carry [.smolA, .redis, .whlpeer]: STAGE=1 bash tools/gpu/race.sh
#   call 2, carry [.smolB, .whl]:             STAGE=1 bash tools/gpu/race.sh   (also prepares the model)
#   call 3, carry [.whlrg]:                   SIDE=streamrl bash tools/gpu/race.sh
#   call 4, carry nothing:                    SIDE=peer bash tools/gpu/race.sh
# At BUDGET=360 on one H100 call 3 takes ~430 s and call 4 ~380 s (scoring five checkpoints with eval.engine
# hf_fast: ~35 s a side). Another pair on the same warm machine is two more calls; give each pair its own seed,
# the same on both sides (run.seed also draws the held-out set):  SIDE=streamrl bash tools/gpu/race.sh run.seed=1
# On a machine with several GPUs, one call runs several sides at once, one per GPU (tools/gpu/on_each_gpu.sh):
#   call 3, carry [.whlrg]:  STAGE=1 bash tools/gpu/race.sh && bash tools/gpu/on_each_gpu.sh \
#     "SIDE=streamrl bash tools/gpu/race.sh run.seed=1" "SIDE=peer bash tools/gpu/race.sh run.seed=1" ...
set -uo pipefail
mkdir -p /tmp/stage /tmp/smol
for d in .smolA .smolB .whl .whlrg .whlpeer .redis; do
  if [[ -d $d && ! -L $d ]]; then  # carried by this call: kept for the later ones (copied once: parallel runs read it)
    [[ "$(ls "$d")" == "$(ls "/tmp/stage/$d" 2>/dev/null)" ]] || { rm -rf "/tmp/stage/$d" && cp -r "$d" /tmp/stage/; }
  elif [[ -d /tmp/stage/$d && ! -e $d ]]; then ln -s "/tmp/stage/$d" "$d"; fi
done
[[ -f /tmp/stage/.whl/gguf-0.19.0-py3-none-any.whl ]] || { echo "race.sh: staged so far: $(ls -A /tmp/stage)"; exit 0; }
source tools/gpu/env.sh || exit 1
# installed once per machine (env.sh's install_wheels): the later calls of a session (the peer, a second pair) skip it
if [[ -d .whlrg ]]; then
  install_wheels .whlrg /tmp/site || exit 1
  # pycosat (reasoning-gym imports it) ships no py3.12 wheel: build it here from its sdist (setuptools is in .whlrg)
  if compgen -G ".whlrg/pycosat-*.tar.gz" >/dev/null && ! python3 -c "import pycosat" 2>/dev/null; then
    python3 -m pip wheel -q --no-index --no-deps --no-build-isolation -w /tmp/pycosat .whlrg/pycosat-*.tar.gz &&
      python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/pycosat/*.whl || exit 1
  fi
fi
# the peer's packages in their own target, on its path only
[[ -d .whlpeer ]] && { install_wheels .whlpeer /tmp/peer || exit 1; }
MODEL=/tmp/smol-dense
if [[ ! -f $MODEL/config.json && -f /tmp/stage/.smolB/part ]]; then
  cat /tmp/stage/.smolA/part /tmp/stage/.smolB/part > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
  python3 -m streamrl.models.prepare --gguf /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf --out $MODEL --experts 0 2>&1 | tail -2
fi
[[ -n ${STAGE:-} ]] && { echo "race.sh: staged: $(ls -A /tmp/stage); model: $(ls $MODEL 2>/dev/null | tr '\n' ' ')"; exit 0; }
SIDE=${SIDE:-streamrl}
[[ $SIDE == peer ]] && export PYTHONPATH=$PYTHONPATH:/tmp/peer
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; uptime
RACE_DIR=${RACE_DIR:-/tmp/race}  # tools/gpu/on_each_gpu.sh gives each parallel run its own
python3 -m streamrl.bench.cli race --config ${CONFIG:-configs/gpu-reasoning.yaml} --side "$SIDE" --phase "${PHASE:-all}" \
  --out "$RACE_DIR" --budget-s "${BUDGET:-360}" model.path=$MODEL "$@" 2>&1 | tail -25
cp "$RACE_DIR"/*.json "$OUT/" 2>/dev/null; for f in "$RACE_DIR"/*.log; do tail -60 "$f" > "$OUT/$(basename "$f")"; done
ls "$RACE_DIR"
