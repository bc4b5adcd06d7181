"""imgpipe.commands: the operations users ask for, wired from the subsystems.

Between the CLI and the subsystems: ``wiring`` builds the registry client, squashfs
storage and local registry from the settings; ``doctor`` checks a machine; ``demo`` runs
the whole workflow on a local cluster.  Imports the subsystems and the base, never the CLI.
"""
