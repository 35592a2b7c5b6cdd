"""Parameter and FLOP counts from a model config, for logging and the MFU estimate.

FLOPs per token follow the PaLM convention: 6 N for the matmuls of forward and backward (N = parameters that
take part in matmuls: everything but the input embedding) plus 12 * layers * attention width * sequence length
for the attention scores and their weighted sum, counted over the full L x L square as is usual (masks are not
subtracted). The LM head only runs on target positions here, so its share is scaled by the fraction of tokens
that are targets.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # input embedding table
    body: int  # decoder layers and the final norm
    head: int  # LM head (0 when tied to the embedding)

    @property
    def total(self) -> int:
        return self.embedding + self.body + self.head


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def param_counts(config: PretrainedConfig) -> ParamCounts:
    """Closed-form counts for a Llama/Mistral config (equals ``sum(p.numel())`` of the built model)."""
    h, f, hd = config.hidden_size, config.intermediate_size, _head_dim(config)
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    attention = h * q + 2 * h * kv + q * h
    if getattr(config, "attention_bias", False):
        attention += q + 2 * kv + h
    mlp = 3 * h * f + ((2 * f + h) if getattr(config, "mlp_bias", False) else 0)
    layer = attention + mlp + 2 * h  # two RMSNorm weights
    embedding = config.vocab_size * h
    return ParamCounts(embedding=embedding, body=config.num_hidden_layers * layer + h,
                       head=0 if config.tie_word_embeddings else embedding)


def flops_per_token(config: PretrainedConfig, seq_len: int, head_fraction: float = 1.0) -> float:
    """Training FLOPs (forward + backward) per input token; ``head_fraction`` = targets / tokens."""
    counts = param_counts(config)
    head_matmul = config.vocab_size * config.hidden_size
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * _head_dim(config) * seq_len
    return 6 * (counts.body + head_fraction * head_matmul) + attention


def mfu(tokens_per_second: float, flops_per_token_: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the hardware peak (same number of devices in both)."""
    return tokens_per_second * flops_per_token_ / peak_flops
