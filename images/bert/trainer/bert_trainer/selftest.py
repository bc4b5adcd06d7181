"""The image's self-test: a tiny masked-LM transformer learns a copy task in a few steps.

Proves that PyTorch imports, autograd and the optimizer work, and that loss
falls; prints one JSON line and exits non-zero when learning fails.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    import torch
    from torch import nn

    torch.manual_seed(12345)
    vocab, length, batch, mask_id = 32, 16, 32, 1
    embed = nn.Embedding(vocab, 64)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2)
    head = nn.Linear(64, vocab)
    position = nn.Parameter(torch.randn(length, 64) * 0.02)
    params = [*embed.parameters(), *encoder.parameters(), *head.parameters(), position]
    optimizer = torch.optim.AdamW(params, lr=3e-3)

    def loss_on_fresh_batch() -> torch.Tensor:
        # Each sequence is one token repeated: a masked token is recoverable from any other.
        tokens = torch.randint(2, vocab, (batch, 1)).expand(batch, length)
        masked = torch.rand(batch, length) < 0.15
        masked[:, 0] |= ~masked.any(dim=1)  # at least one prediction per sequence
        inputs = tokens.masked_fill(masked, mask_id)
        logits = head(encoder(embed(inputs) + position))
        return nn.functional.cross_entropy(logits[masked], tokens[masked])

    started = time.perf_counter()
    with torch.no_grad():
        first = loss_on_fresh_batch().item()
    steps = int(os.environ.get("BERT_SELFTEST_STEPS", "60"))
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_on_fresh_batch()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        last = sum(loss_on_fresh_batch().item() for _ in range(4)) / 4
    passed = last < 0.7 * first
    print(json.dumps({"selftest": "passed" if passed else "failed", "torch": torch.__version__,
                      "cuda": torch.cuda.is_available(), "first_loss": round(first, 4),
                      "final_loss": round(last, 4), "steps": steps,
                      "seconds": round(time.perf_counter() - started, 2)}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
