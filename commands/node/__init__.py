"""imgpipe.commands.node: what runs on compute nodes as the job's user, the Pyxis importer's
work.  A job's start waits on it and it acts on a cache every user shares: it imports
nothing of the build side (commands/builds/, imgpipe.pipeline) or the demo.

Imports go down:

    broadcast       ``broadcast``: one image onto every node of a job at once, where caches
                    are node-local (a chain of TCP connections that MPI sets up)
    chainstep       the broadcast's step once MPI has started: the header, the chain, the
                    batch host's sending, each receiver's copy, the final tally
    batchfetch      the broadcast's fetch on the batch host, in a process of its own (the
                    job starts it ahead of the step; the step's first task follows it)
    nodesite        the settings a broadcast task reads before the chain starts (the fast
                    reader's: no pydantic, no requests)

    fanout          ``stage`` and ``take`` around Slurm's sbcast, where caches are node-local
    foreign         another registry's image, imported as Pyxis does without an importer

    importer        ``get`` and ``release``: a fast path on the standard library, the full
                    conversion otherwise

    cachewriter     conversions every user's jobs take, by the cache's service account

    audit           each import as a line of the site's audit log: the recorder, through sudo
    cache           ``imgpipe cache ls|prune``: what the shared cache holds, kept bounded
    headdigest      the fast path's registry questions: a tag's digest, an index's entry

    auditlog        the recorder itself (``imgpipe-audit``, as root): the checked arguments,
                    the one line, the log root alone reads
"""
