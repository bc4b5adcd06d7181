"""imgpipe.enroot.squash: the flattened root -> a squashfs file.

    enrootimport  `enroot import` as the converter instead (--with-enroot), under
                  imgpipe's cache, lock and naming
    tools         tar2sqfs (fed the stream) and mksquashfs (fed a tree), their options
"""
