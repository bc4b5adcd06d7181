"""Errors of the recipes subsystem (the whole tree is drawn in imgpipe.base.errors)."""

from __future__ import annotations

from imgpipe.base.errors import ImgpipeError


class RecipeError(ImgpipeError):
    """A recipe cannot be rendered, published or pulled as asked."""

    code = "recipe"


class ShapeError(RecipeError):
    """A cluster shape that cannot keep BERT's global batch."""

    exit_code = 2
    code = "shape"


class ProfileError(RecipeError):
    """An unknown or invalid cluster profile."""

    exit_code = 2
    code = "profile"


class SandboxError(RecipeError):
    """The local cluster cannot be started, reached or stopped."""

    code = "sandbox"
