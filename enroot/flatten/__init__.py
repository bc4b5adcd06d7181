"""imgpipe.enroot.flatten: layers -> the flattened root, as one tar stream (or a tree).

Offline by contract: no registry, no HTTP, no cache, no squash tool.  Imports go down:

    streamer    the default path: the root as one tar stream, each layer read once, top
                layer first, checked against the view at the end
    viewwriter  the other path: the view written out (a tar stream, or a tree for
                mksquashfs) from a second read of the layers
    links       hard links in the root, and the hidden bytes they still show
    view        the view: the root the layers make, folded from their headers bottom
                first (the truth both paths are held to; the set-id listing)
    tarwriter   entries of the root as GNU tar, owned by root
    rules       the layer rules: names, dropped entries, whiteouts, kinds, links, modes,
                what no layer described; a change to a rule changes this module only
    tarreader   a layer's tar members: the one reading loop, the end of the archive,
                fast headers
    layerreader the decoder's output read as each layer's tar stream; digests verified
    decoder     blob -> tar bytes and digests, in a process of its own
    rcfiles     Enroot's /etc files (environment, fstab, rc) from the image config
"""
