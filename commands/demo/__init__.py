"""imgpipe.commands.demo: ``./setup.sh demo``, the whole workflow on a local cluster.

Imports go down:

    democli         the entry point (``python -m imgpipe.commands.demo.democli``): the
                    default demo, or with ``--platforms`` the x86-and-Grace one
    demoplatforms   Grace beside x86: base images, one index, a squashfs per platform
    demo            the default: build, push, convert, the sandbox, the jobs, the report
    demojobs        the jobs as the demo shows them, and its closing summary
    demopyxis       what the Pyxis jobs need here: a job user, the importer's venv, the
                    shared squashfs folder and the importer's config
    democorpus      an English corpus from what every Debian machine holds
"""
