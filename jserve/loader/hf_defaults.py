"""What transformers assumes for each config.json field a checkpoint leaves out, per family.

Published configs are not complete: Gemma 3's multimodal checkpoints give their text model only a handful of
fields, Mistral's sliding window is on unless a config says otherwise, Gemma ties its head by default. Reading
a file as transformers does means starting from the same defaults, its config classes' own values
(tests/test_published_configs.py reads a config naming only its architecture both ways). `None` is a
default of "absent", derived later (num_key_value_heads: one per head; head_dim: hidden_size / heads).
"""

from __future__ import annotations

# The fields jserve reads, at the values most transformers configs default them to.
COMMON = {
    "num_key_value_heads": None,  # None: one per attention head
    "head_dim": None,  # None: hidden_size // num_attention_heads
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "sliding_window": None,
    "partial_rotary_factor": 1.0,
    "bos_token_id": None,
    "eos_token_id": None,
}


def _family(**fields) -> dict:
    return COMMON | fields


_QWEN = dict(vocab_size=151936, max_position_embeddings=32768, use_sliding_window=False, sliding_window=4096)

HF_DEFAULTS = {
    "llama": _family(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
    "mistral": _family(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                       sliding_window=4096, bos_token_id=1, eos_token_id=2),
    "qwen2": _family(**_QWEN, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, max_window_layers=28),
    "qwen3": _family(**_QWEN, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, head_dim=128, max_window_layers=28),
    "qwen3_moe": _family(**_QWEN, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                         num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                         moe_intermediate_size=768, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
    "phi3": _family(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                    num_attention_heads=32, rms_norm_eps=1e-5, max_position_embeddings=4096,
                    original_max_position_embeddings=4096, bos_token_id=1, eos_token_id=32000),
    "mixtral": _family(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6,
                       max_position_embeddings=131072, num_local_experts=8, num_experts_per_tok=2, bos_token_id=1,
                       eos_token_id=2),
    "gemma2": _family(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                      tie_word_embeddings=True, sliding_window=4096, query_pre_attn_scalar=256,
                      final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                      hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1),
    "gemma3": _family(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                      tie_word_embeddings=True, sliding_window=4096, sliding_window_pattern=6, rope_theta=1e6,
                      rope_local_base_freq=10000.0, query_pre_attn_scalar=256, final_logit_softcapping=None,
                      attn_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh", bos_token_id=2,
                      eos_token_id=1),
}  # fmt: skip
