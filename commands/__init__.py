"""imgpipe.commands: the operations users ask for, wired from the subsystems, in folders by
who calls them and where they run.

A map for a newcomer (read it first).  Six folders, in import order: each imports only those
below it, never one beside it (an import-linter contract keeps it so and fails on a module
that takes no place here; no module sits at this level, and a test names one that does).

    demo/       ``./setup.sh demo``: the whole workflow on a local cluster, as a user types
                it (it runs the CLI; of commands/ it imports only its own modules)
    builds/     the build side, as a user or CI runs it on a workstation or the head node:
                build, push, self-test and the lock (images), base images, convert, recipes,
                reports, the sandbox, the reference pages generated from the code

    registry/   the registry side: what the registry holds and removing from it, the blob
                cache in front of it, which pushed manifest an image is, squashfs files
                published beside their image
    site/       what root runs once per node or per site: node-config and its check, site
                init, cluster profiles, config show, doctor, NCCL logs against a profile
    node/       what runs on compute nodes as the job's user: the Pyxis importer, the
                fan-out around sbcast, other registries' images, the cache writer it asks,
                cache ls and prune

    shared/     subsystem objects built from the settings (wiring), for every side

Look at node/ first for what runs under a user's job (where the threat model looks first):
it imports nothing of builds/, demo/ or the build subsystem (imgpipe.pipeline); a contract
and tests/unit/test_commands_map.py say so.  Each folder's ``__init__`` maps its own modules
and imports nothing, so the Pyxis importer's fast path loads only the modules it names.
Imports the subsystems and the base, never the CLI.
"""
