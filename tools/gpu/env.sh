# Source on the GPU device machine from the repo root (carry .whl and .redis; see
# ../shared/tools/device-wheels.sh). The device has no package index: wheels go to /tmp/site and
# the project is laid out as the installed package would be (workers/ -> streamrl.workers,
# launcher/ -> streamrl.launcher) under /tmp/pkg.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r streamrl /tmp/pkg/ && cp -r workers /tmp/pkg/streamrl/workers \
  && cp -r launcher /tmp/pkg/streamrl/launcher || return 1
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$PWD/.redis${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PATH=$PWD/.redis:$PATH
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
