"""imgpipe.enroot: registry images -> squashfs files for Enroot, Pyxis and ch-run.

A map for a newcomer (read it first).  Eight entries, in import order: each imports only
those below it, never one beside it (an import-linter contract keeps it so, and fails on a
module that takes no place here).

    convert         `imgpipe convert`: an image, once per digest, into the cache (the lock,
                    a published squashfs or fetch -> flatten -> squash, the rename)
    nodeconfig      the enroot.conf and plugstack.conf lines a site installs (imports
                    nothing of enroot/)

    published/      squashfs files published beside their image: whether one may stand in
                    for a conversion (policy), the artifact (artifact), pins (pins)
    fetch/          an image's blobs into the cache, verified (blobs), handed to the
                    converter as they land (sources), re-fetched when bad (repair)

    flatten/        layers -> the flattened root as a tar stream: the layer rules, the
                    streamer and the view, the decoder; no registry, no cache, no squash tool
    squash/         the root -> a squashfs file: tar2sqfs and mksquashfs (tools), or
                    `enroot import` instead (enrootimport)
    cache/          the cache shared by a cluster's users: its names (storage), a digest's
                    lock (lock), whose files a job may use (trust), setting it up and
                    auditing it (layout), which job steps use what, pruning (uses)

    errors          what conversions raise

Each folder's ``__init__`` maps its own modules and imports nothing, so the Pyxis
importer's fast path loads only the modules it names.
"""
