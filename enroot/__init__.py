"""imgpipe.enroot: registry images -> squashfs files for Enroot, Pyxis and ch-run.

A map for a newcomer (read it first).  A conversion goes down this list and back up:

    convert         `imgpipe convert`: an image, once per digest, into the cache (the lock,
                    the fetch, which path converts, the rename into place)
    fetch           manifest, config and layer blobs into the cache: parallel, verified
    blobrepair      a cached blob gone bad: found after a layer error, fetched again
    sources         an image's layers as the converters read them (blob, digest, diff_id),
                    handed over as their fetches finish
    streamer        the default path: the root as one tar stream, each layer read once, top
                    layer first, checked against the view at the end
    viewwriter      the other path: the view written out (a tar stream, or a tree for
                    mksquashfs) from a second read of the layers
    links           hard links in the root, and the hidden bytes they still show
    view            the view: the root the layers make, folded from their headers bottom
                    first (the truth both paths are held to; the set-id listing)
    tarwriter       the tar writer: entries of the root as GNU tar, owned by root
    layerrules      the layer rules: names, dropped entries, whiteouts, kinds, links,
                    modes, what no layer described; a change to a rule changes this only
    tarreader       a layer's tar members from its stream: the one reading loop, the end
                    of the archive, fast headers
    layerreader     the decoder's output read as each layer's tar stream; verify digests
    decoder         the decoder: blob -> tar bytes and digests, in a process of its own
    rcfiles         Enroot's /etc files (environment, fstab, rc) from the image config
    squash          the squash tools (tar2sqfs, mksquashfs) and their options
    enrootimport    `enroot import` as the converter instead (--with-enroot)

The cache, shared by every user of a cluster:

    storage         its layout and names: every cache path is built here
    cachelock       one digest's lock (NFS-safe, never through a link)
    cachelayout     setting a shared cache up (node-config --make-cache) and auditing it
    cacheuse        which job steps use which entry; pruning
    trust           whose files a job may use (root, the service account, you)
    pins            which published squashfs digests a job trusts for each image
    published       squashfs files published beside their image: find, publish, fetch,
                    check
    publishedpolicy whether a published squashfs may stand in for a conversion
    nodeconfig      the enroot.conf and plugstack.conf lines a site installs
    errors          what conversions raise

Imports go down the first list (``streamer`` and ``viewwriter`` above ``links``, above
``view``, above ``tarwriter``, ``layerrules``, ``tarreader``, ``layerreader`` and
``decoder``), checked by an import-linter contract.
"""
