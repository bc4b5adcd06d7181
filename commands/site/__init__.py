"""imgpipe.commands.site: what root runs once per node or per site (and ``doctor`` and
``config show``, which anyone may run to see what a site set).

Imports go down:

    noderemove      ``imgpipe node-config --remove``: what imgpipe put on a node, taken back
    nodeupgrade     ``imgpipe node-config --upgrade``: a new imgpipe while jobs run

    site            ``imgpipe site init``: the site's config and its own cluster profile
    nodecheck       ``imgpipe node-config --check | --apply``: a node that already runs
                    Pyxis and Enroot, against what imgpipe needs
    nodeconfig      ``imgpipe node-config``: enroot.conf and plugstack.conf lines, the
                    shared cache set up
    config          ``imgpipe config show``: every effective key and the file that set it
    doctor          ``imgpipe doctor``: what this machine has, and how to get what it lacks

    profiles        ``imgpipe recipes profile new|check|list``: a site's own profile
    nodebackup      what ``node-config --apply`` keeps of each file it writes, and
                    ``--rollback`` puts back
    noderunnable    whether a job user can run a node's importer: its way, its interpreter,
                    the Python its venv runs (RHEL 9's python3 is 3.9)
    nodeboot        the node-local squashfs folder: the boot unit ``--apply`` writes, and
                    ``--make-cache``

    nccl            ``imgpipe nccl check``: a log judged against a profile (and the site's
                    profile found by name)
"""
