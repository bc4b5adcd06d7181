"""imgpipe.enroot.cache: the squashfs cache shared by every user of a cluster.

Imports go down:

    layout      setting a shared cache up (node-config --make-cache) and auditing it
    uses        which job steps use which entry; pruning
    storage     its layout and names: every cache path is built here
    lock        one digest's lock (NFS-safe, never through a link)
    rootpath    the cache paths root acts on: walked from /, no link, trusted parents
    trust       whose files a job may use (root, the service account, you)
"""
