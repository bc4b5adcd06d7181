# shellcheck shell=bash
# Enroot 4.1.2 and Pyxis 0.24.0, the runtime the recipes are written for, built from their
# release sources.  Sourced by setup.sh (`./setup.sh peers` runs it alone).
#
# Where the sources come from, first found:
#   $PEERS_DIR (default ../shared/peers beside the checkout): enroot-4.1.2.tar.gz and
#   pyxis-0.24.0.tar.gz, the tags' trees (`git archive --prefix=NAME-VERSION/ TAG`);
#   else $PEERS_BASE_URL (default https://github.com/NVIDIA): the tags' tarballs,
#   /enroot/archive/refs/tags/v4.1.2.tar.gz and /pyxis/archive/refs/tags/v0.24.0.tar.gz.
# Either is checked against the sha256 below before anything is unpacked; a mismatch is
# refused in one line.  A host whose Enroot or Pyxis is already installed keeps it (a
# cluster's own is never replaced): only a missing one is built.  $PEERS_DESTDIR installs
# under another root (a staging tree), as `make install DESTDIR=` does.

ENROOT_VERSION=4.1.2
PYXIS_VERSION=0.24.0
ENROOT_SHA256=817e8d551135e6f3fc311d1ee57b03fb4d30325acba732f8dea43069ca11f8d3
PYXIS_SHA256=063653ba39125ac29796cc6079701d1ec34dd4c5baf698efacc0f36bf3619681
# Enroot's programs in /usr/local/bin (on the PATH Pyxis's end-of-job cleanup uses), its
# configuration where sites keep it; Pyxis where its own Makefile installs it.
ENROOT_PREFIX=/usr/local
ENROOT_SYSCONFDIR=/etc
PYXIS_PLUGIN=/usr/local/lib/slurm/spank_pyxis.so
# Where a Pyxis may already be (as imgpipe's node-config looks for it).
PYXIS_CANDIDATES=(/usr/local/lib/slurm/spank_pyxis.so /usr/lib/slurm/spank_pyxis.so
                  /usr/lib64/slurm/spank_pyxis.so
                  /usr/lib/x86_64-linux-gnu/slurm-wlm/spank_pyxis.so
                  /usr/lib/aarch64-linux-gnu/slurm-wlm/spank_pyxis.so)

peers_log() { printf '[setup] %s\n' "$*" >&2; }
peers_fail() { printf 'setup: %s\n' "$*" >&2; exit 1; }

# The version `enroot version` prints for the enroot at $1 ("" when it prints none), its
# folders pointed at a scratch folder (Enroot makes them on every command).
enroot_version_of() {
  local scratch version
  scratch=$(mktemp -d)
  version=$(ENROOT_RUNTIME_PATH="$scratch/r" ENROOT_CACHE_PATH="$scratch/c" \
    ENROOT_DATA_PATH="$scratch/d" ENROOT_CONFIG_PATH="$scratch/g" "$1" version 2>/dev/null \
    | tail -1) || version=""
  rm -rf "$scratch"
  printf '%s' "$version"
}

# The Pyxis plugin on this host (path and version), from the version mark compiled into it.
installed_pyxis() {
  local candidate mark
  for candidate in "${PYXIS_CANDIDATES[@]}"; do
    candidate="${PEERS_DESTDIR:-}$candidate"
    [ -f "$candidate" ] || continue
    mark=$(grep -ao 'pyxis: version v[0-9.]*' "$candidate" | head -1 | sed 's/.* v//')
    printf '%s %s' "$candidate" "${mark:-unknown}"
    return 0
  done
  return 1
}

# The release tarball $1 (file name) checked against $2 (sha256), from the peers folder or
# downloaded from $3 (URL path under the base); its path on stdout.
peer_source() {
  local name=$1 want=$2 path=$3 dir=${PEERS_DIR:-../shared/peers} got url
  local cache=build/peers
  mkdir -p "$cache"
  if [ -f "$dir/$name" ]; then
    got=$(sha256sum "$dir/$name" | cut -d' ' -f1)
    [ "$got" = "$want" ] || peers_fail "$dir/$name does not match its release's sha256" \
      "($got, not $want): refused; put the tag's own tarball there"
    printf '%s' "$dir/$name"
    return 0
  fi
  url="${PEERS_BASE_URL:-https://github.com/NVIDIA}$path"
  if [ ! -f "$cache/$name" ] || [ "$(sha256sum "$cache/$name" | cut -d' ' -f1)" != "$want" ]; then
    peers_log "no $dir/$name: downloading $url"
    rm -f "$cache/$name" "$cache/$name.partial"
    curl -fsSL --retry 2 --connect-timeout 20 -o "$cache/$name.partial" "$url" 2>/dev/null \
      || { rm -f "$cache/$name.partial"
           peers_fail "cannot get $name: no $dir/$name and $url did not answer; put the" \
             "tag's tarball (sha256 $want) in $dir/"; }
    got=$(sha256sum "$cache/$name.partial" | cut -d' ' -f1)
    if [ "$got" != "$want" ]; then
      rm -f "$cache/$name.partial"
      peers_fail "$url does not match $name's sha256 ($got, not $want): refused; put the" \
        "tag's tarball in $dir/"
    fi
    mv "$cache/$name.partial" "$cache/$name"
  fi
  printf '%s' "$cache/$name"
}

build_enroot() {
  local tarball work=build/peers/enroot-$ENROOT_VERSION
  tarball=$(peer_source "enroot-$ENROOT_VERSION.tar.gz" "$ENROOT_SHA256" \
    "/enroot/archive/refs/tags/v$ENROOT_VERSION.tar.gz")
  peers_log "building Enroot $ENROOT_VERSION from $tarball"
  rm -rf "$work"
  tar -xzf "$tarball" -C build/peers
  # Without its submodules (musl, kernel headers, makeself are for its static release build):
  # Debian's makeself where the Makefile looks for its own, glibc and Debian's libbsd.
  mkdir -p "$work/deps/dist/makeself/bin"
  cp /usr/bin/makeself "$work/deps/dist/makeself/bin/enroot-makeself"
  printf 'deps:\n\t@:\n' > "$work/no-deps.mk"
  make -s -C "$work" -f Makefile -f no-deps.mk FORCE_GLIBC=1 LDLIBS=-lbsd \
    CPPFLAGS="-include bsd/string.h -include bsd/stdlib.h -include bsd/unistd.h -include bsd/stdio.h -include bsd/inttypes.h -D_GNU_SOURCE" \
    DESTDIR="${PEERS_DESTDIR:-/}" prefix="$ENROOT_PREFIX" sysconfdir="$ENROOT_SYSCONFDIR" \
    install >build/peers/enroot-build.log 2>&1 \
    || peers_fail "Enroot $ENROOT_VERSION did not build: see build/peers/enroot-build.log"
  # What Enroot's own `make setcap` (its +caps package) gives: `enroot import` by users.
  local bin="${PEERS_DESTDIR:-}$ENROOT_PREFIX/bin"
  if ! setcap cap_sys_admin+pe "$bin/enroot-mksquashovlfs" \
      || ! setcap cap_sys_admin,cap_mknod+pe "$bin/enroot-aufs2ovlfs"; then
    peers_fail "setcap on Enroot's helpers failed (apt-get install libcap2-bin)"
  fi
}

build_pyxis() {
  local tarball work=build/peers/pyxis-$PYXIS_VERSION
  [ -f /usr/include/slurm/spank.h ] \
    || peers_fail "Pyxis needs Slurm's spank.h: apt-get install libslurm-dev"
  tarball=$(peer_source "pyxis-$PYXIS_VERSION.tar.gz" "$PYXIS_SHA256" \
    "/pyxis/archive/refs/tags/v$PYXIS_VERSION.tar.gz")
  peers_log "building Pyxis $PYXIS_VERSION from $tarball"
  rm -rf "$work"
  tar -xzf "$tarball" -C build/peers
  make -s -C "$work" >build/peers/pyxis-build.log 2>&1 \
    || peers_fail "Pyxis $PYXIS_VERSION did not build: see build/peers/pyxis-build.log"
  install -D -m 644 "$work/spank_pyxis.so" "${PEERS_DESTDIR:-}$PYXIS_PLUGIN"
}

install_peers() {
  local enroot found version
  mkdir -p build/peers
  enroot="${PEERS_DESTDIR:-}$ENROOT_PREFIX/bin/enroot"
  [ -x "$enroot" ] || enroot=$(PATH="${PEERS_DESTDIR:+$PEERS_DESTDIR$ENROOT_PREFIX/bin:}$PATH" \
    command -v enroot || true)
  if [ -n "$enroot" ]; then
    version=$(enroot_version_of "$enroot")
    if [ "$version" != "$ENROOT_VERSION" ]; then
      peers_log "keeping this host's Enroot ${version:-of unknown version} ($enroot)"
    fi
  else
    build_enroot
  fi
  if found=$(installed_pyxis); then
    if [ "${found#* }" != "$PYXIS_VERSION" ]; then
      peers_log "keeping this host's Pyxis ${found#* } (${found% *})"
    fi
  else
    build_pyxis
  fi
}
