"""Paged attention: the batch metadata, the KV cache arrays, the backend contract and its plain-JAX reference."""

from jserve.attention.backend import ATTENTION_BACKENDS, CPU, REFERENCE, AttentionBackend, resolve_attention_backend
from jserve.attention.kv_cache import (
    KVCache,
    KVPages,
    allocate_kv_cache,
    cache_writer_compiler_options,
    kv_cache_bytes_per_token,
)
from jserve.attention.limits import fit_attention_backend
from jserve.attention.metadata import PAD_SLOT, AttentionMetadata, ModelInput, SequenceChunk, build_model_input
from jserve.attention.reference import paged_attention, write_kv

__all__ = [
    "ATTENTION_BACKENDS",
    "CPU",
    "REFERENCE",
    "AttentionBackend",
    "resolve_attention_backend",
    "PAD_SLOT",
    "AttentionMetadata",
    "KVCache",
    "KVPages",
    "ModelInput",
    "SequenceChunk",
    "allocate_kv_cache",
    "cache_writer_compiler_options",
    "build_model_input",
    "fit_attention_backend",
    "kv_cache_bytes_per_token",
    "paged_attention",
    "write_kv",
]
