"""Parameter and FLOP counts from a model config, and devices' peaks, for logging, the planner and the MFU estimate.

FLOPs follow the PaLM convention: 6 N per token for the matmuls of forward and backward (N = parameters that
take part in matmuls: everything but the input embedding; of a mixture-of-experts layer only the experts a token
is routed to) plus 12 * layers * attention width per attended (query, key) pair for the attention scores and their
weighted sum, counted over the full square of each attention segment as is usual (a causal mask is not
subtracted). The LM head only runs on target positions here, so it counts once per target. ``flops_per_token``
is the planner's per-token average (segments of the sequence length, a head share); the trainer's MFU counts each
step's real ``Work``: the tokens the body ran (SimCSE and SSCL run two views of every unit), the LM head's
targets, and the documents' own squares.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from pipeline.model.moe import is_moe, num_experts

# Dense bf16 peak TFLOPs per device, for the MFU estimate (matched as a substring of the device name).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A10G": 125.0, "L40S": 362.0, "L4": 121.0,
               "MI250X": 383.0, "MI300X": 1307.0, "V100": 125.0}


def device_peak_tflops(configured: float) -> float:
    if configured > 0:
        return configured
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
    return 0.0


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # input embedding table
    body: int  # decoder layers and the final norm
    head: int  # LM head (0 when tied to the embedding)
    active_body: int | None = None  # body parameters one token runs through (MoE: its top-k experts); None: body

    @property
    def active(self) -> int:
        """Body parameters each token's matmuls use: what its FLOPs count."""
        return self.body if self.active_body is None else self.active_body

    @property
    def total(self) -> int:
        return self.embedding + self.body + self.head


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def param_counts(config: PretrainedConfig) -> ParamCounts:
    """Closed-form counts for a Llama/Mistral config (equals ``sum(p.numel())`` of the built model); a
    mixture-of-experts config is counted on its model built on the meta device (:func:`moe_param_counts`)."""
    if is_moe(config):
        return moe_param_counts(config.to_json_string(use_diff=False))
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


@functools.cache
def moe_param_counts(config_json: str) -> ParamCounts:
    """Counts of the MoE config ``config_json`` (its JSON: a cache key), read off its model built on the meta
    device: the routed experts' parameters (``.experts.``) count in full in ``body`` and by ``top_k / experts`` in
    ``active_body``; shared experts, routers and attention run for every token. The class is built directly, not
    through ``from_config``, which under a live ZeRO-3 config (the trainer's) would partition and initialise it."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.for_model(**json.loads(config_json))
    with torch.device("meta"):
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    sizes = {name: p.numel() for name, p in model.named_parameters(remove_duplicate=False)}
    embedding = sizes.pop("model.embed_tokens.weight")
    head = 0 if config.tie_word_embeddings else sizes.pop("lm_head.weight")
    sizes.pop("lm_head.weight", None)
    experts = sum(n for name, n in sizes.items() if ".experts." in name)
    body = sum(sizes.values())
    return ParamCounts(embedding=embedding, body=body, head=head,
                       active_body=body - experts + experts * config.num_experts_per_tok // num_experts(config))


@dataclass(frozen=True)
class Work:
    """What forward passes ran: the model FLOPs of a step follow from it (``work_flops``)."""

    tokens: float  # tokens through the decoder body (padding left out)
    head_targets: float  # positions through the LM head
    attended_pairs: float  # (query, key) pairs: the square of each attention segment's length, summed


def segment_lengths(doc_ids: torch.Tensor, document_masking: bool) -> torch.Tensor:
    """Token count of each attention segment of rows ``doc_ids`` [B, L] (document index, -1 = padding): each
    document, or each row's tokens when document masking is off. Padding belongs to none."""
    real = (doc_ids >= 0).double()
    if not document_masking:
        return real.sum(-1)
    per_document = torch.zeros(doc_ids.shape[0], doc_ids.shape[1] + 1, dtype=torch.float64, device=doc_ids.device)
    return per_document.scatter_add_(1, doc_ids.long() + 1, real)[:, 1:]  # column 0 gathered the padding


def body_work(lengths: torch.Tensor) -> torch.Tensor:
    """float64 [2] on ``lengths``' device: (tokens, attended pairs) of attention segments of these lengths; on the
    device, so the trainer sums it with its other counts and reads everything back at once."""
    lengths = lengths.double()
    return torch.stack([lengths.sum(), lengths.square().sum()])


def work_flops(config: PretrainedConfig, work: Work) -> float:
    """Training FLOPs (forward + backward) of ``work``."""
    head_matmul = config.vocab_size * config.hidden_size
    attention_per_pair = 12 * config.num_hidden_layers * config.num_attention_heads * _head_dim(config)
    return (6 * (param_counts(config).active * work.tokens + head_matmul * work.head_targets)
            + attention_per_pair * work.attended_pairs)


def flops_per_token(config: PretrainedConfig, seq_len: int, head_fraction: float = 1.0) -> float:
    """Training FLOPs (forward + backward) per input token of ``seq_len``-token segments; ``head_fraction`` =
    targets / tokens."""
    return work_flops(config, Work(tokens=1.0, head_targets=head_fraction, attended_pairs=float(seq_len)))


def mfu(tokens_per_second: float, flops_per_token_: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the hardware peak (same number of devices in both)."""
    return tokens_per_second * flops_per_token_ / peak_flops
