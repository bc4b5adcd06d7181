"""imgpipe.pipeline: the build subsystem.

The catalog of images, change planning (input hashes), BuildKit builds through the
engine adapter, the build records and the lock file, pushes to the head node's registry.
It uses imgpipe.registry and imgpipe.base, never the CLI or the commands above it.
"""
