"""BERT model configuration: the usual ``bert_config.json`` keys, BERT-Large by default."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path


class ConfigError(ValueError):
    """A config file that cannot describe a BERT model; the message names the file and key."""


# hidden_act as each ecosystem writes it -> the trainer's two GeLUs: exact (erf) and tanh.
# transformers writes gelu_pytorch_tanh (and reads gelu_new, the same function);
# DeepLearningExamples' LinearActivation turns gelu into bias_gelu.
ACTIVATIONS = {"gelu": "gelu", "bias_gelu": "gelu", "gelu_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}

# What makes two BERTs the same network: compared between a checkpoint (its weights, the
# config beside it) and the run's config before a step runs.
ARCHITECTURE = ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size",
                "vocab_size", "max_position_embeddings", "type_vocab_size", "hidden_act",
                "layer_norm_eps")


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 4096
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary rounded up to a multiple of 8 (tensor-core friendly: 30522 -> 30528)."""
        return (self.vocab_size + 7) // 8 * 8

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def encoder_parameters(self) -> int:
        """Weights in the transformer layers (what the matmul FLOPs scale with)."""
        h, f = self.hidden_size, self.intermediate_size
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
        return self.num_hidden_layers * per_layer

    def training_flops_per_sequence(self, seq_len: int, predictions: int) -> float:
        """Matmul FLOPs of forward + backward (3x forward) for one sequence.

        Per token and layer: 2 x the layer's weights, plus 4 x seq_len x hidden for
        the attention scores and the weighted sum; the MLM head runs only at the
        ``predictions`` masked positions, the pooler and NSP head once.
        """
        h, layers = self.hidden_size, self.num_hidden_layers
        matmul = 2 * self.encoder_parameters() * seq_len
        attention = layers * 4 * seq_len * seq_len * h
        heads = predictions * 2 * (h * h + h * self.padded_vocab_size) + 2 * (h * h + 2 * h)
        return 3.0 * (matmul + attention + heads)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    def architecture(self) -> dict[str, object]:
        """The fields of ``ARCHITECTURE`` and their values."""
        return {name: getattr(self, name) for name in ARCHITECTURE}

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> BertConfig:
        known = {f.name: f.type for f in fields(cls)}
        # Files from other trainers carry extra keys (architectures, model_type, ...).
        kept = {k: v for k, v in values.items() if k in known}
        for name, wanted in (("model_type", "bert"), ("position_embedding_type", "absolute")):
            if values.get(name, wanted) != wanted:
                raise ConfigError(f"{source}: {name}: this trainer trains {wanted}, not "
                                  f"{values[name]!r}")
        act = kept.get("hidden_act", "gelu")
        if not isinstance(act, str) or act not in ACTIVATIONS:
            raise ConfigError(f"{source}: hidden_act: must be one of "
                              f"{', '.join(ACTIVATIONS)}, not {act!r}")
        kept["hidden_act"] = ACTIVATIONS[act]
        config = cls(**kept)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{source}: {name}: must be a positive integer, not {value!r}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(config, name)
            if not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ConfigError(f"{source}: {name}: must be in [0, 1), not {value!r}")
        if config.hidden_size % config.num_attention_heads:
            raise ConfigError(f"{source}: hidden_size {config.hidden_size} is not a multiple of "
                              f"num_attention_heads {config.num_attention_heads}")
        eps = config.layer_norm_eps
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
            raise ConfigError(f"{source}: layer_norm_eps: must be in (0, 1), not {eps!r}")
        return config

    @classmethod
    def load(cls, path: str | Path | None) -> BertConfig:
        """BERT-Large when ``path`` is None, else the JSON file at ``path``."""
        if path is None:
            return cls()
        try:
            values = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: not a readable JSON file ({exc})") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: must hold a JSON object")
        return cls.from_dict(values, str(path))


TINY = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=128,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
