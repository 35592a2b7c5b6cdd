"""Named model shapes: the Llama-style architectures of the MLM-vs-CLM study, Llama-3-8B's, and tiny ones for tests.

Every preset shares the block design of that study (no biases, RMSNorm, SwiGLU, untied embeddings); the sizes,
RoPE theta (10 000; Llama-3: 500 000) and context differ. A preset with ``experts`` replaces each SwiGLU MLP by
that many routed SwiGLU experts of ``ffn_size`` (Mixtral's block, ``experts_per_token`` of them per token). The
vocabulary is not part of a preset: it comes from the data's tokenizer. See docs/models.md for where each shape
comes from and its parameter count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaConfig, MixtralConfig


@dataclass(frozen=True)
class ModelPreset:
    num_layers: int
    hidden_size: int
    ffn_size: int
    num_heads: int
    num_kv_heads: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    experts: int = 0  # routed experts per layer (a Mixtral block); 0: the dense SwiGLU MLP
    experts_per_token: int = 2

    def to_config(self, vocab_size: int, **special_ids: int | None) -> LlamaConfig | MixtralConfig:
        """The HF config of this shape; ``special_ids`` are ``pad_token_id``, ``bos_token_id``, ``eos_token_id``.
        transformers is imported here, not with the presets, so checking an experiment's preset imports none of it."""
        from transformers import LlamaConfig, MixtralConfig

        if self.experts:
            return MixtralConfig(**self._shape(vocab_size), num_local_experts=self.experts,
                                 num_experts_per_tok=self.experts_per_token, **special_ids)
        return LlamaConfig(**self._shape(vocab_size), attention_bias=False, mlp_bias=False, **special_ids)

    def _shape(self, vocab_size: int) -> dict:
        return dict(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.ffn_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.hidden_size // self.num_heads,
            max_position_embeddings=self.max_seq_len,
            hidden_act="silu",
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=False,
            use_cache=False,
        )


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(num_layers=2, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=2, max_seq_len=256),
    # ~20M parameters with an 8K vocabulary (14.2M in the blocks): the from-scratch size 2 CPU cores can train
    # (make reproduce, docs/results.md)
    "20m": ModelPreset(num_layers=6, hidden_size=384, ffn_size=1536, num_heads=6, num_kv_heads=6, max_seq_len=512),
    "210m": ModelPreset(num_layers=12, hidden_size=768, ffn_size=3072, num_heads=12, num_kv_heads=12),
    "610m": ModelPreset(num_layers=26, hidden_size=1152, ffn_size=4096, num_heads=18, num_kv_heads=6),
    # The paper's appendix table as recapped (28 layers, FFN 5120), not the reverted EuroBERT commit (26, 4096).
    "1b": ModelPreset(num_layers=28, hidden_size=1728, ffn_size=5120, num_heads=18, num_kv_heads=6),
    "7b": ModelPreset(num_layers=32, hidden_size=4096, ffn_size=11008, num_heads=32, num_kv_heads=32),
    # Llama-3-8B: grouped-query attention (8 KV heads), FFN 14336, RoPE theta 500 000, context 8192
    "8b": ModelPreset(num_layers=32, hidden_size=4096, ffn_size=14336, num_heads=32, num_kv_heads=8, max_seq_len=8192,
                      rope_theta=500000.0),
    # "tiny" with 4 routed experts, 2 per token: the mixture-of-experts path on CPU
    "tiny-moe": ModelPreset(num_layers=2, hidden_size=64, ffn_size=128, num_heads=4, num_kv_heads=2, max_seq_len=256,
                            experts=4),
}


def get_preset(name: str) -> ModelPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)} "
                         "(or give a local HF checkpoint directory)")
    return PRESETS[name]
