#!/usr/bin/env bash
# Fresh-machine setup for imgpipe, idempotent.  Debian 12, as root.
#
#   ./setup.sh demo   install, then the whole BERT workflow on this machine: build, self-test,
#                     push and convert the bert image (cpu flavor, offline-capable), a local
#                     Slurm sandbox (head + 2 compute hosts), dataset.sub, run.sub phase 1
#                     and 2, nccl.sub in containers, and a report (outputs under ./build,
#                     lock in ./imgpipe.lock).  Idempotent.  `./setup.sh demo --down` stops
#                     the sandbox and the registry.  `./setup.sh demo --platforms
#                     linux/amd64,linux/arm64`: bert for x86 and Grace (arm64, emulated here),
#                     one index, phase 1 a few steps on an x86 and an arm64 sandbox node
#                     (build/demo-platforms; downloads PyPI's aarch64 torch, ~2.9 GB, once).
#   ./setup.sh test   install, then run the whole test suite (the tests start and
#                     stop the engine and registries they need)
#   ./setup.sh check  install, then the static checks alone: ruff, mypy, import-linter
#   ./setup.sh        install only (this machine as the demo and the tests need it)
#   ./setup.sh peers  Enroot 4.1.2 and Pyxis 0.24.0 alone (the modes above do it too): built
#                     from their release sources in ../shared/peers/, else the tags' tarballs
#                     from GitHub, each checked against its sha256 before it is built; a host
#                     that has an Enroot or a Pyxis of its own keeps it
#
# A cluster's hosts (docs/admin.md) never take the modes above, which install Slurm, munge,
# chromium, qemu and Charliecloud and turn binfmt on.  They take:
#
#   ./setup.sh build-host [--arm64]   as root, on the build host (a CI runner, the head
#                     node): Docker's engine, squashfs tools, git, python3-venv, and imgpipe
#                     in .venv, nothing else; --arm64 adds qemu-user-static and
#                     binfmt-support (entries for every architecture qemu emulates; Grace
#                     images are built under emulation).  Idempotent.
#   ./setup.sh node-wheels   no root, no apt: imgpipe's wheel and every wheel it needs, for
#                     x86 nodes (dist/nodes/x86_64) and Grace nodes (dist/nodes/aarch64),
#                     CPython ${PYTHON_VERSION:-3.11}, glibc ${NODE_GLIBC:-2.36} at most (RHEL 9:
#                     NODE_GLIBC=2.34); a node installs them with
#                     `pip install --no-index --find-links dist/nodes/$(uname -m) imgpipe`
set -euo pipefail
cd "$(dirname "$0")"

mode=${1:-install}
case "$mode" in
  install|demo|test|check|peers|build-host|node-wheels) ;;
  *) echo "usage: $0 [install|demo|test|check|peers|build-host [--arm64]|node-wheels]" >&2
     exit 2 ;;
esac

# What a build host needs: the engine (BuildKit comes with it), the squashfs tools that
# convert and publish, git, and a Python for imgpipe's venv.
BUILD_HOST_PACKAGES=(
  docker.io                          # engine with BuildKit (20.10 client)
  squashfs-tools squashfs-tools-ng   # mksquashfs/unsquashfs, tar2sqfs
  git ca-certificates
  python3 python3-venv python3-pip
)
EMULATION_PACKAGES=(qemu-user-static binfmt-support)  # arm64 (Grace) built under emulation

# Enroot and Pyxis from source (no Debian packages): what their builds need, and what Enroot
# runs (jq, parallel, zstd, pigz, squashfs tools, fuse-overlayfs, squashfuse). Pyxis is built
# against Slurm's own spank.h (libslurm-dev, the same release as slurm-wlm).
PEERS_PACKAGES=(
  make gcc libc6-dev libbsd-dev makeself libtool autoconf automake pkg-config libslurm-dev
  jq parallel zstd pigz squashfs-tools fuse-overlayfs squashfuse curl ca-certificates
  libcap2-bin slurm-wlm
)

# This machine as the demo and the tests need it: a build host, and the head node, a rack
# host, a login node and compute nodes of a sandbox cluster on top.
PACKAGES=(
  "${BUILD_HOST_PACKAGES[@]}" "${EMULATION_PACKAGES[@]}"
  docker-registry                    # registry 2.8 (the head node's)
  debootstrap                        # base images without a public registry
  apache2-utils                      # htpasswd for registry auth
  nginx-light                        # the blob cache tier (imgpipe registry cache up)
  slurm-wlm munge iproute2           # the multi-host sandbox Slurm (network namespaces)
  charliecloud-runtime squashfuse fuse3   # ch-run: jobs in containers from squashfs files
  openmpi-bin python3-mpi4py libpmix-dev  # enroot.distribution: broadcast (srun --mpi=pmix;
                                     # Slurm's pmix plugin loads libpmix.so, the -dev link)
  shellcheck curl util-linux
  sudo                               # the cache writer's one sudoers line (tests/e2e/test_tenants.py)
  logrotate                          # the audit log's rotation (tests/e2e/test_audit.py)
  chromium                           # headless: the report page's test
  g++ python3-dev                    # torch.compile's CPU backend (the trainer's compile test)
  "${PEERS_PACKAGES[@]}"
)

log() { printf '[setup] %s\n' "$*" >&2; }

install_packages() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
      || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

# The first of PYTHON, python3, python3.12, python3.11 that is 3.11 or newer (RHEL 9's
# python3 is 3.9); empty when none is.
python_311() {
  local candidate
  for candidate in ${PYTHON:-python3 python3.12 python3.11}; do
    if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
}

new_venv() {
  local python
  python=$(python_311)
  if [ -z "$python" ]; then
    echo "setup.sh: no Python 3.11 or newer (${PYTHON:-python3}: $(${PYTHON:-python3} \
--version 2>&1)): install one (RHEL: dnf install python3.11) or name it with PYTHON=" >&2
    exit 2
  fi
  if [ -x .venv/bin/python ] && ! .venv/bin/python -c \
      'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    log "replacing .venv: made with $(.venv/bin/python --version 2>&1), imgpipe needs 3.11+"
    rm -rf .venv
  fi
  if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $($python --version)"
    "$python" -m venv .venv
  fi
}

# A build host's imgpipe: the project alone, no test extras, no torch.
make_build_venv() {
  new_venv
  local stamp=.venv/.imgpipe-build-host
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    log "installing imgpipe (editable) into .venv"
    .venv/bin/pip install -q --disable-pip-version-check -e .
    touch "$stamp"
  fi
}

make_venv() {
  new_venv
  # Reinstall only when the project's requirements changed.
  local stamp=.venv/.imgpipe-installed
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
      || [ images/bert/trainer/pyproject.toml -nt "$stamp" ]; then
    log "installing imgpipe (editable) with test extras, and the bert trainer with CPU torch"
    .venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
    # torch 2.13.0's CPU wheel is on disk here (pip's find-links); PyPI's is a CUDA build.
    .venv/bin/pip install -q --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}" \
      -e images/bert/trainer
    touch "$stamp"
  fi
}

# arm64 programs run here through qemu-aarch64, registered with the fix-binary flag (F): it
# then works inside containers and ch-run's namespaces too.
enable_emulation() {
  local entry=/proc/sys/fs/binfmt_misc/qemu-aarch64
  if [ -e "$entry" ] && head -1 "$entry" | grep -q enabled; then return 0; fi
  mountpoint -q /proc/sys/fs/binfmt_misc \
    || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  log "enabling qemu-aarch64 (binfmt)"
  update-binfmts --enable qemu-aarch64
}

engine_answers() { /usr/bin/docker version >/dev/null 2>&1; }

start_engine() {
  engine_answers && return 0
  mkdir -p build
  log "starting dockerd (log: build/dockerd.log)"
  # No bridge or iptables: builds and containers use the host network.
  nohup dockerd --bridge=none --iptables=false >build/dockerd.log 2>&1 &
  for _ in $(seq 1 120); do engine_answers && return 0; sleep 0.5; done
  log "dockerd did not answer within 60 s; see build/dockerd.log"; exit 1
}

# ruff; mypy on `-p imgpipe` through a link tree that lays the folders out as the installed
# package (pyproject.toml's [tool.mypy] says why); the layer contracts.
static_checks() {
  log "ruff check, mypy, import-linter's layer contracts"
  .venv/bin/ruff check .
  rm -rf build/typecheck
  mkdir -p build/typecheck/imgpipe
  local folder
  for folder in cli commands pipeline registry enroot recipes base; do
    ln -s "../../../$folder" "build/typecheck/imgpipe/$folder"
  done
  (cd build/typecheck && ../../.venv/bin/python -m mypy --config-file ../../pyproject.toml \
    -p imgpipe)
  .venv/bin/lint-imports --no-cache
}

# Every wheel imgpipe needs on a node of each architecture, from PyPI (or the pip mirror the
# build host's pip configuration names): binary wheels only, checked to resolve offline.
node_wheels() {
  local python=${PYTHON:-} version=${PYTHON_VERSION:-3.11} out=dist/nodes
  # the nodes' glibc (ldd --version): wheels that need a newer one are never taken (RHEL 9:
  # NODE_GLIBC=2.34)
  local node_glibc=${NODE_GLIBC:-2.36}
  if ! [[ $node_glibc =~ ^2\.(1[7-9]|[2-9][0-9])$ ]]; then
    echo "setup.sh node-wheels: NODE_GLIBC=$node_glibc: say the nodes' glibc as 2.N," \
      "N 17 or more (ldd --version on a node)" >&2
    exit 2
  fi
  if [ -z "$python" ]; then
    python=python3
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; fi
  fi
  rm -rf "$out.partial"
  mkdir -p "$out.partial/wheel"
  log "building imgpipe's wheel"
  "$python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$out.partial/wheel" .
  local wheel arch glibc tags
  wheel=$(ls "$out.partial"/wheel/imgpipe-*.whl)
  for arch in x86_64 aarch64; do
    tags=()
    for glibc in $(seq 17 "${node_glibc#2.}"); do
      tags+=(--platform "manylinux_2_${glibc}_$arch")
    done
    tags+=(--platform "manylinux2014_$arch")
    if [ "$arch" = x86_64 ]; then
      tags+=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64)
    fi
    log "downloading the wheels for $arch nodes (CPython $version, glibc $node_glibc)"
    "$python" -m pip download -q --disable-pip-version-check --only-binary=:all: \
      --implementation cp --python-version "$version" "${tags[@]}" \
      -d "$out.partial/$arch" "$wheel"
    cp "$wheel" "$out.partial/$arch/"
    # the set must be complete: resolved again from the folder alone, for that platform
    "$python" -m pip install -q --disable-pip-version-check --dry-run --ignore-installed \
      --no-index --find-links "$out.partial/$arch" --only-binary=:all: --implementation cp \
      --python-version "$version" "${tags[@]}" --target "$out.partial/check" imgpipe
  done
  rm -rf "$out.partial/wheel" "$out.partial/check" "$out"
  mv "$out.partial" "$out"
  log "done: $out/x86_64 and $out/aarch64; on a node: python3 -m venv /opt/imgpipe &&" \
    "/opt/imgpipe/bin/pip install --no-index --find-links $out/\$(uname -m) imgpipe" \
    "(RHEL 9: python3.11 -m venv)"
}

# shellcheck source=setup-peers.sh
. ./setup-peers.sh

case "$mode" in
  node-wheels) node_wheels; exit 0 ;;
  peers)
    if [ "$(id -u)" -ne 0 ] && [ -z "${PEERS_DESTDIR:-}" ]; then
      echo "setup.sh peers: run it as root" >&2; exit 2
    fi
    if [ -z "${PEERS_SKIP_PACKAGES:-}" ]; then install_packages "${PEERS_PACKAGES[@]}"; fi
    install_peers
    exit 0
    ;;
  build-host)
    if [ "$(id -u)" -ne 0 ]; then echo "setup.sh build-host: run it as root" >&2; exit 2; fi
    if ! command -v dpkg-query >/dev/null; then
      # Not Debian's: its packages are the admin's to install (RHEL/Rocky: dnf install
      # python3.11 squashfs-tools git, Docker CE from Docker's repository, and tar2sqfs from
      # squashfs-tools-ng where the host converts); then the venv, from PYTHON.
      log "no dpkg here: install Docker (BuildKit), squashfs-tools 4.5+, squashfs-tools-ng" \
        "(tar2sqfs, for push --squashfs), git and Python 3.11+ yourself (RHEL 9: dnf install" \
        "python3.11 git; Docker CE from Docker's repository; squashfs-tools-ng from EPEL;" \
        "RHEL's squashfs-tools is 4.4: mksquashfs 4.5+ from source or push with zstd, which" \
        "tar2sqfs makes); making .venv with the first Python 3.11+ found"
      make_build_venv
      log "done: .venv/bin/imgpipe doctor (the engine must run: systemctl enable --now docker)"
      exit 0
    fi
    case "${2:-}" in
      "") install_packages "${BUILD_HOST_PACKAGES[@]}" ;;
      --arm64) install_packages "${BUILD_HOST_PACKAGES[@]}" "${EMULATION_PACKAGES[@]}"
               enable_emulation ;;
      *) echo "usage: $0 build-host [--arm64]" >&2; exit 2 ;;
    esac
    make_build_venv
    log "done: .venv/bin/imgpipe doctor (the engine must run: systemctl enable --now docker)"
    exit 0
    ;;
esac

install_packages "${PACKAGES[@]}"
enable_emulation
install_peers
make_venv

case "$mode" in
  install) log "done: .venv/bin/imgpipe --help" ;;
  check) static_checks ;;
  test)
    static_checks
    log "pytest"
    exec .venv/bin/python -m pytest "${@:2}"
    ;;
  demo)
    if [ "${2:-}" != "--down" ]; then start_engine; fi
    exec .venv/bin/python -m imgpipe.commands.demo.democli "${@:2}"
    ;;
esac
