#!/usr/bin/env bash
# The first hour on a cluster that already runs Pyxis and Enroot
# (docs/admin.md shows this file).  Your site's answers come first; every
# step after them is idempotent and says what it did.
# tests/e2e/test_first_hour.py runs this very file on the sandbox cluster.
set -euo pipefail

# The head node's registry, and the CA that signed its certificate ("": http)
REGISTRY=${REGISTRY-head:5000}
REGISTRY_CA=${REGISTRY_CA-/etc/pki/site-ca.crt}
# Whether it asks for logins: netrc (each user's ~/.netrc: machine HOST login USER password
# PASSWORD, 0600; the nodes' importer reads the job user's), docker-config, or "" for none
CREDENTIALS=${CREDENTIALS-}
# The squashfs folder, and how images reach it on the nodes (empty: shared when
# SQUASHFS is on a cluster file system, else site init asks; sbcast / fetch /
# broadcast for a node-local folder, the same path on every node, e.g.
# /var/lib/imgpipe/squashfs, need ACCEPT=importer; step 3 installs the unit that
# makes it at each boot); the partition jobs run in; the folder for data,
# checkpoints and results
SQUASHFS=${SQUASHFS-/lustre/imgpipe/squashfs}
DISTRIBUTION=${DISTRIBUTION-}
# The cache's service account (empty: none, root makes the folder); on Lustre
# or NFS with root squash, name it: it makes the folder's layout, not root (the
# file system's admin gives it SQUASHFS's parent folder first)
CACHE_OWNER=${CACHE_OWNER-}
PARTITION=${PARTITION-gpu}
DATA=${DATA-/lustre/bert}
# The shipped profile nearest your nodes, and how yours differ (empty: as
# shipped; e.g. --hcas mlx5_0,mlx5_1 --cores-per-node 96: only the compute
# rails, never storage HCAs; cores or hardware threads, either is understood)
PROFILE_FROM=${PROFILE_FROM-dgx-h100}
NODE_SHAPE=${NODE_SHAPE-}
# ngc: NVIDIA's PyTorch base; the images built from imgpipe's checkout; how
# jobs run their image
FLAVOR=${FLAVOR-ngc}
IMAGES=${IMAGES-bert nccl-tests}
RUNTIME=${RUNTIME-pyxis}
# The first jobs: nodes, tasks (GPUs) per node, and the user who runs them
# (never root: Enroot refuses root's jobs; default: who ran sudo)
NODES=${NODES-2}
TASKS=${TASKS-8}
AS_USER=${AS_USER-${SUDO_USER:-}}
# Lines that change the site's jobs, taken (space-separated; node-config prints
# each, commented, with what it changes): importer (importer= on the site's
# Pyxis line), pyxis (a Pyxis line where there is none), container_scope,
# squashfuse
ACCEPT=${ACCEPT-}
# A node image instead of this host; imgpipe as installed on the nodes;
# imgpipe's checkout (its catalog and lock)
NODE_ROOT=${NODE_ROOT-/}
# The site config step 3 installs on a node (a copy of the login node's, e.g.
# from a folder every node sees; root's, in a folder only root may write)
SITE_CONFIG_FILE=${SITE_CONFIG_FILE-/etc/imgpipe/imgpipe.yaml}
IMGPIPE=${IMGPIPE-$(command -v imgpipe || echo /opt/imgpipe/bin/imgpipe)}
CHECKOUT=${CHECKOUT-$(cd "$(dirname "$0")/.." && pwd)}
# Which steps to run here: 1 and 4 on the login node (as root; step 4 runs as
# AS_USER, in CHECKOUT, which that user must be able to write), 2 on the build
# host, 3 on each compute node (STEPS=3 through pdsh or clush; with NODE_ROOT a
# node image, STEPS="1 2 3 4" on one host)
STEPS=${STEPS-1 2 4}
say() { printf '\n== %s\n' "$*"; }
step() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
as_user() {
  if [ -n "$AS_USER" ]; then runuser -u "$AS_USER" -- "$@"; else "$@"; fi
}

importer=--no-pyxis-importer accept=()
for line in $ACCEPT; do
  accept+=(--accept "$line")
  if [ "$line" = importer ]; then importer=--pyxis-importer; fi
done
distribution=()
if [ -n "$DISTRIBUTION" ]; then distribution=(--distribution "$DISTRIBUTION"); fi
owner=()
if [ -n "$CACHE_OWNER" ]; then owner=(--cache-owner "$CACHE_OWNER"); fi
logins=()
if [ -n "$CREDENTIALS" ]; then logins=(--credentials "$CREDENTIALS"); fi

if step 1; then
say "1. the site's config and profile (login node, as root)"
tls=(--plain-http)
if [ -n "$REGISTRY_CA" ]; then tls=(--registry-ca "$REGISTRY_CA"); fi
# A site config edited since it was written is kept; any other refusal stops here.
# shellcheck disable=SC2086 # NODE_SHAPE is flags
if ! said=$("$IMGPIPE" site init --registry "$REGISTRY" "${tls[@]}" "${logins[@]}" \
    --squashfs-dir "$SQUASHFS" "${distribution[@]}" "${owner[@]}" "$importer" \
    --partition "$PARTITION" --data-root "$DATA" \
    --flavor "$FLAVOR" --from "$PROFILE_FROM" $NODE_SHAPE 2>&1); then
  echo "$said" >&2
  case "$said" in
    *"exists already, with other values"*)
      echo "site init: the site config differs from these answers: kept as it is (edit it," \
        "or run site init --force)" ;;
    *) exit 1 ;;
  esac
else
  echo "$said"
fi
if [ -z "$DISTRIBUTION" ] || [ "$DISTRIBUTION" = shared ]; then
  # the shared folder, once, from a host that mounts it (node-local folders: a
  # boot unit on each node, docs/admin.md)
  if [ -n "$CACHE_OWNER" ]; then
    (cd / && runuser -u "$CACHE_OWNER" -- "$IMGPIPE" node-config --make-cache "$SQUASHFS")
  else
    "$IMGPIPE" node-config --make-cache "$SQUASHFS"
  fi
fi
"$IMGPIPE" config show --origin
"$IMGPIPE" doctor || echo "doctor: the lines above say what this host lacks"
fi

cd "$CHECKOUT"
if step 2; then
say "2. the images (build host, in imgpipe's checkout)"
if [ -n "$IMAGES" ]; then
  # shellcheck disable=SC2086 # IMAGES is a list
  "$IMGPIPE" build $IMAGES --flavor "$FLAVOR"
  "$IMGPIPE" push --squashfs
fi
fi

# Step 3 acts on the host it runs on (NODE_ROOT: a node image instead): run it on
# each compute node (pdsh, clush, the node image), never on the login node.
if step 3; then
say "3. imgpipe on each compute node (as root; NODE_ROOT for a node image)"
"$IMGPIPE" node-config --check --root "$NODE_ROOT" --site-config "$SITE_CONFIG_FILE"
"$IMGPIPE" node-config --apply --root "$NODE_ROOT" --site-config "$SITE_CONFIG_FILE" \
    "${accept[@]}"
case "$DISTRIBUTION" in
  fetch|sbcast|broadcast)
    # --apply wrote the unit that makes the node-local folder at each boot (before
    # slurmd); on the node itself it made the folder now too
    echo "node-local $SQUASHFS: /etc/systemd/system/imgpipe-cache.service makes it at boot" ;;
esac
# The profile's file must be on the node too (a copy of the login node's
# /etc/imgpipe/profiles, or a profiles_dir every node sees).
"$IMGPIPE" recipes profile check site \
  || echo "profile: edit the site's profiles/site.yaml (on the login node) and copy it"
fi

step 4 || exit 0
say "4. the first jobs (login node, as a user, in the checkout)"
if [ "$(id -u)" = 0 ] && [ -z "$AS_USER" ]; then
  echo "step 4: set AS_USER to the user who runs the first jobs (not root)" >&2
  exit 2
fi
if [ -n "$CREDENTIALS" ]; then
  # Each user's own login, read by the login node's commands and by the nodes' importer
  # as the job's user; without one, jobs end in one line naming it.
  as_user "$IMGPIPE" registry status >/dev/null \
    || echo "step 4: $AS_USER needs a registry login first (~/.netrc, 0600)" >&2
fi
# Under DATA, which every node sees: sbatch --chdir must exist on the nodes too.
recipes="$DATA/first-hour-recipes"
as_user mkdir -p "$recipes"
if [ "$importer" = --no-pyxis-importer ]; then
  # Pyxis without imgpipe's importer: the recipes pin the squashfs files that
  # convert makes in the shared folder (and records in the lock).
  for image in ${IMAGES:-bert}; do
    flavor=$FLAVOR
    if [ "$image" = nccl-tests ]; then flavor=ngc; fi
    as_user "$IMGPIPE" convert -q "$image" --flavor "$flavor" >/dev/null
  done
fi
if [ "$RUNTIME" != pyxis ]; then
  # No Pyxis to ask: the job is handed the squashfs file itself.
  CONT=$(as_user "$IMGPIPE" convert -q bert --flavor "$FLAVOR"); export CONT
fi
as_user "$IMGPIPE" recipes render --profile site --nodes "$NODES" \
    --runtime "$RUNTIME" -o "$recipes"
job=$(as_user sbatch --parsable --wait -N"$NODES" --ntasks-per-node="$TASKS" \
    --chdir "$recipes" "$recipes/nccl.sub")
as_user "$IMGPIPE" nccl check "$DATA/results/nccl-$job.log" --profile site \
    --nodes "$NODES"
as_user "$IMGPIPE" report "$DATA/results"
