"""BERT pre-training for GPU clusters (the payload of imgpipe's bert image)."""

__version__ = "0.1.0"
