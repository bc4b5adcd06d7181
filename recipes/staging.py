"""Getting the job's image onto its nodes where squashfs caches are node-local: the
``stage_image`` shell function of run.sub, dataset.sub and nccl.sub.

``enroot.distribution`` says how the cluster keeps squashfs files:

``shared``
    one folder on the cluster file system: the first node's import serves every node (no
    function; Pyxis's importer does it all).
``fetch``
    a node-local folder on each node: every node's importer fetches for itself (the
    baseline; a cache tier in front of the registry carries it for racks).
``sbcast``
    a node-local folder: the batch host's importer gets the image once (``stage``), Slurm's
    ``sbcast`` copies it along slurmd's tree to every node of the job, and every node's
    importer takes the copy only if it hashes to the pin (``take``); a node without a good
    copy fetches for itself and says so.  The registry serves one squashfs per job.
``broadcast``
    a node-local folder: one ``srun --mpi=pmix`` step of one task per node
    (``broadcast``): the batch host's task fetches the pinned squashfs and streams each
    chunk its ranged fetch has checked to every node that lacks the image, through Open
    MPI's pipelined broadcast (each node forwards a segment while it receives the next),
    every node writing and hashing as it receives; nodes holding the image take no part.
    sbcast's three stages one after another (the whole fetch, a store-and-forward tree,
    each node's full sha256 pass) become one pipeline: N nodes cost about one.  Without a
    pin for the image, Slurm's pmix plugin, or MPI on the nodes (the step fails), it stages
    with sbcast instead, in one line.  The batch host's fetch starts with the job (the
    importer's ``ahead``, in the background), not with the step: it runs while srun starts
    a task on every node, and the step's first task follows it.

Every failure on the way is one line and the job still starts: sbcast missing or failing,
the batch host unable to get the image, a corrupt copy.  With Charliecloud the function
also sets ``CONT`` to the entry every node now holds (the same path on each node).
"""

from __future__ import annotations

import shlex
from typing import Literal, get_args

Distribution = Literal["shared", "fetch", "sbcast", "broadcast"]
DISTRIBUTIONS: tuple[str, ...] = get_args(Distribution)

_FUNCTION = r'''
# The image onto every node of the job (enroot.distribution: @MODE@): node-local caches.
# IMGPIPE_IMPORTER (default: the site's) runs on every node as the job's user; IMGPIPE_SBCAST,
# IMGPIPE_SBCAST_FANOUT and IMGPIPE_SBCAST_BLOCK override sbcast, its tree width and block.
default_importer=@IMPORTER@
IMGPIPE_IMPORTER="${IMGPIPE_IMPORTER:-$default_importer}"
stage_image() {
  local nodes=${SLURM_JOB_NUM_NODES:-1} staged=() got line ahead="" ahead_pid=""
  local mode=${IMGPIPE_DISTRIBUTION:-@MODE@}
  local uri=$CONT sbcast=${IMGPIPE_SBCAST:-sbcast}
  case "$uri" in /*|./*) return 0 ;; esac  # a squashfs path: nothing to stage
  if [ "$mode" = broadcast ] && [ "$nodes" -gt 1 ]; then
    mode=sbcast
    case " ${IMGPIPE_SQUASHFS_PINS:-} " in
      *" ${uri##*@}="*)
        # the batch host's fetch starts with the job, while srun starts a task on every
        # node; the step's first task follows its words (a folder of this user's alone)
        if ahead=$(mktemp -d -t imgpipe-ahead.XXXXXXXX); then
          "$IMGPIPE_IMPORTER" ahead "$uri" "$ahead" &
          ahead_pid=$!
        fi
        if ! srun --mpi=list 2>&1 | grep -qw pmix; then
          echo "${0##*/}: Slurm has no pmix plugin here (srun --mpi=list): staging with" \
            "sbcast" >&2
        else
          # MPI starts the step and says where each node listens (the bytes go down a chain
          # of TCP connections); waiting ranks yield their core instead of spinning on it;
          # no memory patcher (with it, 2 of 6 sandbox runs lost a task to SIGSEGV; it serves
          # RDMA registration caches).  A second try where the first failed: a task's MPI
          # start crashes now and then (Open MPI 4.1.4's TCP transport calls a callback not
          # yet set inside MPI_Init: 2-12 % of 16-task steps in the sandbox)
          local try
          for try in 1 2; do
            if got=$(IMGPIPE_BROADCAST_AHEAD="$ahead" OMPI_MCA_mpi_yield_when_idle=1 \
                OMPI_MCA_memory='^patcher' srun -N"$nodes" -n"$nodes" --ntasks-per-node=1 \
                --mpi=pmix --kill-on-bad-exit=1 "$IMGPIPE_IMPORTER" broadcast "$uri" \
                | sort -u); then
              mode=broadcast
              break
            elif [ "$try" = 1 ]; then
              echo "${0##*/}: the broadcast of $uri failed: trying it once more" >&2
            else
              echo "${0##*/}: the broadcast of $uri failed: staging with sbcast" >&2
            fi
          done
        fi ;;
      *) echo "${0##*/}: $uri has no squashfs pin (IMGPIPE_SQUASHFS_PINS): staging with" \
           "sbcast" >&2 ;;
    esac
    if [ -n "$ahead_pid" ]; then  # over with the broadcast; sbcast's stage finds its entry
      wait "$ahead_pid" || true
    fi
    if [ -n "$ahead" ]; then
      rm -rf "$ahead"
    fi
  fi
  if [ "$mode" = sbcast ] && [ "$nodes" -gt 1 ]; then
    if ! line=$("$IMGPIPE_IMPORTER" stage "$uri"); then
      echo "${0##*/}: the batch host could not get $uri: every node fetches it" >&2
    else
      read -r -a staged <<<"$line"  # source sha256 destination manifest
      if ! command -v "$sbcast" >/dev/null 2>&1; then
        echo "${0##*/}: $sbcast is not on this host's PATH: every node fetches the image" >&2
      # An already-compressed squashfs: no compression. sbcast creates each copy
      # exclusively, under a name nobody could guess.
      elif ! "$sbcast" --compress=none --fanout="${IMGPIPE_SBCAST_FANOUT:-@FANOUT@}" \
          --size="${IMGPIPE_SBCAST_BLOCK:-@BLOCK@}" "${staged[0]}" "${staged[2]}"; then
        echo "${0##*/}: sbcast of ${staged[0]##*/} failed: nodes without a good copy" \
          "fetch the image themselves" >&2
      fi
      staged=("${staged[1]}" "${staged[2]}" "${staged[3]}")
    fi
  fi
  if [ "$mode" != broadcast ]; then
    got=$(srun -N"$nodes" -n"$nodes" --ntasks-per-node=1 --kill-on-bad-exit=1 \
      "$IMGPIPE_IMPORTER" take "$uri" "${staged[@]}" | sort -u) || {
      echo "${0##*/}: a node could not get $uri" >&2; exit 1; }
  fi
@AFTER@}
stage_image
'''

_CHARLIECLOUD_AFTER = r'''  case "$got" in
    *$'\n'*|'') echo "${0##*/}: the nodes hold $uri under different names: $got" >&2; exit 1 ;;
  esac
  CONT=$got
'''


def stage_function(runtime: str, distribution: str, importer: str, fanout: int,
                   block: str) -> str:
    """Bash that defines and runs ``stage_image`` (empty for a shared cache or the host
    runtime, which runs no image)."""
    if distribution == "shared" or runtime == "host":
        return ""
    after = _CHARLIECLOUD_AFTER if runtime == "charliecloud" else "  : \"$got\"\n"
    return (_FUNCTION.replace("@MODE@", distribution)
            .replace("@IMPORTER@", shlex.quote(importer))
            .replace("@FANOUT@", str(int(fanout)))
            .replace("@BLOCK@", shlex.quote(block))
            .replace("@AFTER@", after)).strip("\n")
