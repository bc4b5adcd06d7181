"""imgpipe.commands.shared: what every side of commands/ uses.

    wiring          subsystem objects from the settings: the registry client, squashfs
                    storage, the local registry (the one place they are wired together)
"""
