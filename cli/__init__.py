"""imgpipe.cli: the command line (parse, call, render), top of the layers.

``imgpipe`` (``main``: a click group that imports each subcommand's module on first use)
and ``imgpipe-pyxis-importer`` (``importer``: the program Pyxis and Enroot call), the cache
writer (``cachewriter``) and the audit recorder (``audit``), both run through sudo.
Nothing below imports from here.
"""
