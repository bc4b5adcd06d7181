"""`imgpipe sandbox`: the local multi-host Slurm cluster (``imgpipe.recipes.sandbox``), as
the CLI drives it."""

from __future__ import annotations

from imgpipe.recipes.sandbox import MAX_COMPUTE_NODES, Sandbox, SandboxError, SandboxSpec

__all__ = ["MAX_COMPUTE_NODES", "Sandbox", "SandboxError", "SandboxSpec"]
