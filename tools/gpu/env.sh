# Source on the GPU device machine from the repo root (carry .whl and .redis; see
# ../shared/tools/device-wheels.sh). The device has no package index: wheels go to /tmp/site and
# the project is laid out as the installed package would be (workers/ -> streamrl.workers,
# launcher/ -> streamrl.launcher).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
# This checkout is the device's own copy: lay workers/ and launcher/ into the package in place
# (python -m puts the working directory first on sys.path, so it must be complete here).
rm -rf streamrl/workers streamrl/launcher && cp -r workers streamrl/workers && cp -r launcher streamrl/launcher || return 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$PWD/.redis${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PATH=$PWD/.redis:$PATH
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
