"""imgpipe.enroot.published: squashfs files published beside their image.

    policy      whether a published squashfs may stand in for a conversion (pinned, or
                the site's opt-in checked against the layers), and fetching it when so
    relay       a published squashfs relayed between the nodes of one job: what the
                sender's fetch has checked, a receiver's copy written and hashed as it
                comes, each node's stage times
    artifact    the OCI artifact: find it among the referrers, publish (with chunk
                digests), fetch (as verified ranges, registry.ranges)
    pins        which published squashfs digests a job trusts for each image (the
                importer's fast path reads them with the standard library alone)
    chain       how relayed bytes travel: segments down a chain of the job's nodes, each
                forwarded as it lands, a window of them in flight on every link
    contents    the check a fetched or received squashfs passes before it becomes an
                entry (kinds, owners, set-id files), and the rename that makes it one
    inodes      what a squashfs file holds (paths, kinds, modes, owners), read from its
                binary tables: no name can make an entry read as another
"""
