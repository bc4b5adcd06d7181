"""imgpipe.commands.registry: the registry side, on the head node or by CI.

Imports go down:

    registry        ``imgpipe registry status|ls|tags|rm|gc``: what the registry holds, and
                    removing only what was proven to belong to what is removed
    blobcache       ``imgpipe registry cache``: the blob cache (nginx) in front of it
    published       a squashfs published beside its image, and verifying what is published

    pushed          which pushed manifest an image of the catalog is: one answer for every
                    command (the lock's entry, else the registry's)
"""
