"""BERT with the pre-training heads, written for speed on GPUs.

- Attention goes through ``F.scaled_dot_product_attention``, which picks the
  flash or memory-efficient fused kernel on GPUs (a padding mask rules out only
  the flash one) and the math path on CPUs.
- Linear layers that feed a pointwise epilogue run without their bias, and the
  epilogues (bias + GeLU; bias + dropout + residual + LayerNorm) are plain
  functions of whole tensors, so ``torch.compile`` fuses each into one kernel.
- The MLM head runs only at the ``max_predictions_per_seq`` masked slots of each
  sequence (about 15% of the tokens), and its decoder shares the word embedding
  matrix, whose rows are padded to a multiple of 8.
- Unpadded (the default): the encoder runs on the real tokens alone, one
  ``[tokens, hidden]`` tensor, with attention by sequence length (``unpad.py``), so
  padding costs no matmul, no elementwise pass and no attention; ``unpadded=False``
  keeps the padded ``[batch, seq, hidden]`` path, which the tests compare it with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bert_trainer import unpad
from bert_trainer.config import BertConfig
from bert_trainer.unpad import Varlen

IGNORE = -100  # label of unused masked-LM slots (F.cross_entropy's ignore_index)


def bias_gelu(bias: torch.Tensor | None, y: torch.Tensor, approximate: str) -> torch.Tensor:
    return F.gelu(y if bias is None else y + bias, approximate=approximate)


def bias_dropout_add_layernorm(y: torch.Tensor, bias: torch.Tensor | None,
                               residual: torch.Tensor, norm: nn.LayerNorm, p: float,
                               training: bool) -> torch.Tensor:
    return norm(residual + F.dropout(y if bias is None else y + bias, p, training))


def project(linear: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` times ``linear``'s weight, and the bias still to add (an epilogue adds it).

    A plain ``nn.Linear`` gives its bias to the epilogue, fused there; a layer of another
    class (``--fp8``: torchao's ``Float8Linear``, fp8.py) runs its own forward, bias
    included, since its matmul is not ``F.linear``."""
    if type(linear) is nn.Linear:
        return F.linear(x, linear.weight), linear.bias
    return linear(x), None


class Embeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = config.hidden_dropout_prob

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        summed = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
                  + self.token_type_embeddings(token_type_ids))
        return F.dropout(self.LayerNorm(summed), self.dropout, self.training)

    def forward_unpadded(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                         layout: Varlen) -> torch.Tensor:
        """The same per token, for the real tokens alone: ``[T, hidden]``."""
        index = layout.token_index
        summed = (self.word_embeddings(input_ids.reshape(-1)[index])
                  + self.position_embeddings(index % layout.seq)
                  + self.token_type_embeddings(token_type_ids.reshape(-1)[index]))
        return F.dropout(self.LayerNorm(summed), self.dropout, self.training)


class Layer(nn.Module):
    """One post-LayerNorm transformer layer (BERT's layout)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.heads = config.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h)  # query, key and value in one matmul
        self.attention_out = nn.Linear(h, h)
        self.attention_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(h, f)
        self.output = nn.Linear(f, h)
        self.output_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.hidden_dropout = config.hidden_dropout_prob
        self.attention_dropout = config.attention_probs_dropout_prob
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Padded: ``x`` is [B, S, hidden], ``attention_mask`` the key mask [B, 1, 1, S]."""
        batch, seq, hidden = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.heads, hidden // self.heads)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, S, d]
        context = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask,
            dropout_p=self.attention_dropout if self.training else 0.0)
        return self._after_attention(context.transpose(1, 2).reshape(batch, seq, hidden), x)

    def forward_unpadded(self, x: torch.Tensor, layout: Varlen) -> torch.Tensor:
        """Unpadded: ``x`` is [T, hidden], the real tokens of the batch ``layout`` describes."""
        tokens, hidden = x.shape
        qkv = self.qkv(x).view(tokens, 3, self.heads, hidden // self.heads)
        query, key, value = qkv.unbind(1)  # each [T, heads, d]
        context = unpad.attention(query, key, value, layout,
                                  self.attention_dropout if self.training else 0.0)
        return self._after_attention(context.reshape(tokens, hidden), x)

    def _after_attention(self, context: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, LayerNorm, then the feed-forward block (any shape)."""
        y, bias = project(self.attention_out, context)
        x = bias_dropout_add_layernorm(y, bias, x, self.attention_norm, self.hidden_dropout,
                                       self.training)
        y, bias = project(self.intermediate, x)
        inner = bias_gelu(bias, y, self.approximate)
        y, bias = project(self.output, inner)
        return bias_dropout_add_layernorm(y, bias, x, self.output_norm, self.hidden_dropout,
                                          self.training)


class BertForPreTraining(nn.Module):
    """Encoder + masked-LM head (tied decoder) + next-sentence head."""

    def __init__(self, config: BertConfig, unpadded: bool = True) -> None:
        super().__init__()
        self.config = config
        self.unpadded = unpadded
        h = config.hidden_size
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.mlm_transform = nn.Linear(h, h)
        self.mlm_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.mlm_bias = nn.Parameter(torch.zeros(config.padded_vocab_size))
        self.pooler = nn.Linear(h, h)
        self.nsp = nn.Linear(h, 2)
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def encode(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
               attention_mask: torch.Tensor) -> torch.Tensor:
        """The encoder's output [B, S, hidden] (``BertModel``'s ``last_hidden_state``)."""
        # True where a key may be attended to, broadcast over heads and queries.
        keep = attention_mask.bool()[:, None, None, :]
        x = self.embeddings(input_ids, token_type_ids)
        for layer in self.layers:
            x = layer(x, keep)
        return x

    def pooled(self, encoded: torch.Tensor) -> torch.Tensor:
        """The pooler's output [B, hidden]: tanh of a linear layer at [CLS]."""
        return torch.tanh(self.pooler(encoded[:, 0]))

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                attention_mask: torch.Tensor, masked_lm_positions: torch.Tensor,
                token_index: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLM logits [B, P, vocab] at the masked slots and NSP logits [B, 2].

        The decoder runs over the padded vocabulary (tensor-core shapes); the padding's
        logits are dropped, so they take no share of the softmax: the loss is the one
        ``transformers`` computes for the unpadded model.  ``token_index``/``cu_seqlens``
        (``unpad.host_index`` of the mask, from the data loader) spare the unpadded path
        computing them on the device; without them it does."""
        if not self.unpadded:
            x = self.encode(input_ids, token_type_ids, attention_mask)
            hidden = x.shape[-1]
            index = masked_lm_positions.long().unsqueeze(-1).expand(-1, -1, hidden)
            at_masks = torch.gather(x, 1, index)  # [B, P, H]: only the masked positions
            first = x[:, 0]
        else:
            layout = unpad.varlen(attention_mask, token_index, cu_seqlens)
            tokens = self.encode_unpadded(input_ids, token_type_ids, layout)
            rows = torch.arange(layout.batch, device=tokens.device).unsqueeze(1) * layout.seq
            at_masks = tokens[unpad.unpad_rows(layout, masked_lm_positions.long() + rows)]
            first = tokens[layout.cu_seqlens[:-1].long()]  # [CLS] of each sequence
        return self._heads(at_masks, first)

    def encode_unpadded(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                        layout: Varlen) -> torch.Tensor:
        """The encoder's output at the real tokens alone: [T, hidden]."""
        x = self.embeddings.forward_unpadded(input_ids, token_type_ids, layout)
        for layer in self.layers:
            assert isinstance(layer, Layer)  # for mypy: ModuleList items are Modules
            x = layer.forward_unpadded(x, layout)
        return x

    def _heads(self, at_masks: torch.Tensor, first: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        transformed = self.mlm_norm(bias_gelu(self.mlm_transform.bias,
                                              F.linear(at_masks, self.mlm_transform.weight),
                                              self.approximate))
        mlm_logits = F.linear(transformed, self.embeddings.word_embeddings.weight, self.mlm_bias)
        return (mlm_logits[..., :self.config.vocab_size],
                self.nsp(torch.tanh(self.pooler(first))))

    def no_decay_names(self) -> set[str]:
        """Biases and LayerNorm parameters: LAMB applies no weight decay to them."""
        names = set()
        for module_name, module in self.named_modules():
            for name, _ in module.named_parameters(recurse=False):
                full = f"{module_name}.{name}" if module_name else name
                if isinstance(module, nn.LayerNorm) or name.endswith("bias"):
                    names.add(full)
        return names


def pretraining_loss(mlm_logits: torch.Tensor, mlm_labels: torch.Tensor,
                     nsp_logits: torch.Tensor, nsp_labels: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean MLM cross-entropy over real masked slots + mean NSP cross-entropy, in fp32.

    Returns (loss, correct MLM predictions, real masked slots): the last two as
    tensors, so reading them does not synchronize the device until logging.
    """
    flat_logits = mlm_logits.reshape(-1, mlm_logits.shape[-1]).float()
    flat_labels = mlm_labels.reshape(-1).long()
    mlm = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE)
    nsp = F.cross_entropy(nsp_logits.float(), nsp_labels.long())
    real = flat_labels != IGNORE
    correct = ((flat_logits.argmax(-1) == flat_labels) & real).sum()
    return mlm + nsp, correct, real.sum()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

