"""imgpipe.enroot.fetch: an image's blobs into the cache, and over to the converter.

    sources     the layers as the converters read them (blob, digest, diff_id), handed
                over as their fetches finish
    repair      a cached blob gone bad: found after a layer error, fetched again
    blobs       manifest, config and layer blobs into the cache: parallel, verified
"""
