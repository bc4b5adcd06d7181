"""`imgpipe sandbox`: the local multi-host Slurm cluster (``imgpipe.recipes.sandbox``), as
the CLI drives it."""

from __future__ import annotations

from imgpipe.recipes.sandbox import Sandbox, SandboxError, SandboxSpec

__all__ = ["Sandbox", "SandboxError", "SandboxSpec"]
