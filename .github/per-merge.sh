#!/usr/bin/env bash
# What the images workflow runs on every merge, as the runner's own user: no apt, no root
# (the docker group is enough).  An admin set the runner up once (docs/images.md, "CI on a head
# node"): the packages, the runner user in the docker group, a venv with imgpipe's
# dependencies at $IMGPIPE_VENV that the runner user owns, and the site's imgpipe.yaml.
#
#   IMGPIPE_VENV=/opt/imgpipe-ci/venv IMGPIPE_SITE_CONFIG=/etc/imgpipe/imgpipe.yaml \
#     .github/per-merge.sh ngc
#
# actions/checkout leaves no imgpipe.lock (it is not committed, and a clean checkout wipes
# ignored files): the registry is the source of truth.  `lock pull` writes the lock back
# from the pushed images' labels, so `ci` builds only what changed.
set -euo pipefail
flavor=${1:-ngc}
cd "$(dirname "$0")/.."
: "${IMGPIPE_VENV:?set IMGPIPE_VENV to the runner venv (docs/images.md: CI on a head node)}"
: "${IMGPIPE_SITE_CONFIG:?set IMGPIPE_SITE_CONFIG to the site imgpipe.yaml}"
if [ "$(id -u)" -eq 0 ]; then
  echo "per-merge: run this as the runner's user, not root" >&2
  exit 2
fi
# The site's own file is read in place (every command reads /etc/imgpipe/imgpipe.yaml first);
# another path is copied in as the checkout's project config, which, being the runner's file,
# may not set the keys the threat model trusts (enroot.cache_owner, enroot.cache_writer).
if [ "$IMGPIPE_SITE_CONFIG" != /etc/imgpipe/imgpipe.yaml ]; then
  install -m 0644 "$IMGPIPE_SITE_CONFIG" imgpipe.yaml
fi
"$IMGPIPE_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
  --force-reinstall --no-build-isolation .
imgpipe="$IMGPIPE_VENV/bin/imgpipe"
"$imgpipe" lock pull --flavor "$flavor"
"$imgpipe" ci --flavor "$flavor" --squashfs  # convert once, publish beside the image
