"""The encoder on real tokens only: padding removed before the first layer, attention by length.

A batch of B sequences padded to S tokens becomes one ``[T, hidden]`` tensor of its T real
tokens (row-major: sequence 0's tokens, then sequence 1's, ...).  Every matmul, GeLU,
dropout and LayerNorm of the encoder then runs on T rows instead of B x S; only attention
needs to know where one sequence ends, which ``cu_seqlens`` (the running sum of the
lengths, ``[B + 1]``, int32) tells it.

Attention picks, per call:

- on a GPU in bf16/fp16, FlashAttention's variable-length kernel
  (``aten::_flash_attention_forward`` with ``cum_seq_q``/``cum_seq_k``, the op that
  ``torch.nn.attention.varlen.varlen_attn`` wraps; called directly because that wrapper
  has no attention dropout, which BERT pre-training uses);
- anywhere else (the CPU, fp32): the tokens are scattered back into a zero ``[B, S]``
  layout and go through ``F.scaled_dot_product_attention`` with the key padding mask, the
  very call the padded path makes, so the CPU result is the padded path's.

A token's position is its column in the padded batch (``token_index % S``), so holes in
a mask are handled as the padded path handles them.  The one requirement: every
sequence's first token is real (it is [CLS] in every BERT instance); the pooler and NSP
head read it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

# FlashAttention's limits: 16-bit inputs, head sizes up to 256 in multiples of 8.
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


class Varlen(NamedTuple):
    """Where the real tokens of a padded ``[batch, seq]`` batch are."""

    token_index: torch.Tensor  # [T] int64: row * seq + column of each real token
    cu_seqlens: torch.Tensor  # [batch + 1] int32: sequence b is rows cu[b]:cu[b + 1]
    keep: torch.Tensor  # [batch, 1, 1, seq] bool: the key mask (for the padded fallback)
    batch: int
    seq: int


class PaddingError(ValueError):
    """A batch the unpadded path cannot take (a sequence whose first token is padding)."""


def host_index(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(token_index int64, cu_seqlens int32) of a ``[B, S]`` 0/1 mask, computed on the host
    (the data loader does this, so the device never waits for a ``nonzero``)."""
    mask = np.asarray(mask).astype(bool)
    if mask.shape[1] and not mask[:, 0].all():
        row = int(np.flatnonzero(~mask[:, 0])[0])
        raise PaddingError(f"sequence {row} of the batch starts with padding (every BERT "
                           "instance starts with [CLS])")
    lengths = mask.sum(axis=1)
    cu = np.zeros(len(mask) + 1, np.int32)
    np.cumsum(lengths, out=cu[1:])
    return np.flatnonzero(mask.reshape(-1)).astype(np.int64), cu


def device_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``host_index`` for a mask on any device (on a GPU it waits for the device)."""
    flat = mask.reshape(-1).bool()
    if mask.shape[1] and not bool(mask[:, 0].bool().all()):
        row = int((~mask[:, 0].bool()).nonzero()[0, 0])
        raise PaddingError(f"sequence {row} of the batch starts with padding (every BERT "
                           "instance starts with [CLS])")
    cu = F.pad(mask.bool().sum(dim=1).cumsum(0), (1, 0)).to(torch.int32)
    return flat.nonzero().squeeze(1), cu


def varlen(attention_mask: torch.Tensor, token_index: torch.Tensor | None = None,
           cu_seqlens: torch.Tensor | None = None) -> Varlen:
    """The layout of ``attention_mask``'s real tokens; the indices are computed here unless
    given (the trainer passes the data loader's)."""
    if token_index is None or cu_seqlens is None:
        token_index, cu_seqlens = device_index(attention_mask)
    batch, seq = attention_mask.shape
    return Varlen(token_index, cu_seqlens, attention_mask.bool()[:, None, None, :], batch, seq)


def unpad_rows(layout: Varlen, padded_rows: torch.Tensor) -> torch.Tensor:
    """Rows of the unpadded tensor that hold the padded batch's flat positions
    ``padded_rows`` (row * seq + column, each a real token)."""
    ranks = torch.cumsum(layout.keep.reshape(-1).long(), 0) - 1
    return ranks[padded_rows]


def flash_usable(query: torch.Tensor) -> bool:
    head = query.shape[-1]
    return (query.is_cuda and query.dtype in _FLASH_DTYPES and head % 8 == 0 and head <= 256)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: Varlen,
              dropout_p: float) -> torch.Tensor:
    """Attention within each sequence of ``[T, heads, head_size]`` tensors -> same shape."""
    if flash_usable(query):
        # max_q/max_k: the padded length bounds every sequence; a bound serves the kernel
        # (it sizes the grid) and asks the host for nothing.
        out = torch.ops.aten._flash_attention_forward(
            query, key, value, layout.cu_seqlens, layout.cu_seqlens, layout.seq, layout.seq,
            dropout_p, False, False)
        return out[0]
    return _padded_attention(query, key, value, layout, dropout_p)


def _padded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      layout: Varlen, dropout_p: float) -> torch.Tensor:
    """The padded path's SDPA call on the tokens scattered back to ``[B, S]`` (zeros at the
    padding, which the key mask hides and whose query rows are dropped)."""
    heads, size = query.shape[1], query.shape[2]
    slots = layout.batch * layout.seq

    def padded(tensor: torch.Tensor) -> torch.Tensor:
        full = tensor.new_zeros(slots, heads, size).index_copy(0, layout.token_index, tensor)
        return full.view(layout.batch, layout.seq, heads, size).transpose(1, 2)

    context = F.scaled_dot_product_attention(padded(query), padded(key), padded(value),
                                             attn_mask=layout.keep, dropout_p=dropout_p)
    return context.transpose(1, 2).reshape(slots, heads, size)[layout.token_index]
