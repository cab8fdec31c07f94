# Source on the GPU device machine from the repo root (carry .whl and .redis; see
# ../shared/tools/device-wheels.sh). The device has no package index: wheels go to /tmp/site and
# the project is laid out as the installed package would be (workers/ -> streamrl.workers,
# launcher/ -> streamrl.launcher).
# Both steps are skipped when already done, so runs sourcing this in parallel (tools/gpu/on_each_gpu.sh,
# after one has sourced it alone) do not rewrite what the others are reading.

# install_wheels DIR TARGET: pip-install DIR's wheels into TARGET, unless that same set of files was
# installed there already (a later call of the session, on the warm machine)
install_wheels() {
  local marker="$2/.installed-${1#.}"
  [[ -f $marker && "$(cat "$marker")" == "$(ls "$1")" ]] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl || return 1
  ls "$1" > "$marker"
}
install_wheels .whl /tmp/site || return 1
# This checkout is the device's own copy: lay workers/ and launcher/ into the package in place
# (python -m puts the working directory first on sys.path, so it must be complete here).
if ! diff -rq -x __pycache__ workers streamrl/workers >/dev/null 2>&1 || ! diff -rq -x __pycache__ launcher streamrl/launcher >/dev/null 2>&1; then
  rm -rf streamrl/workers streamrl/launcher && cp -r workers streamrl/workers && cp -r launcher streamrl/launcher || return 1
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$PWD/.redis${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PATH=$PWD/.redis:$PATH
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
