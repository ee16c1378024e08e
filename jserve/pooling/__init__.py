"""Embedding models: one vector per input, pooled from the model's hidden states as the checkpoint's
sentence-transformers files say (config.py, sentence_transformers.py), statistics per chunk on the device
(statistics.py), the vector made on the host (vectors.py); an engine of its own (engine.py, runner.py) that
reuses the scheduler and KV cache but neither decodes nor samples."""

from jserve.pooling.config import DECODER_DEFAULT, PoolingConfig, parse_pooler_config
from jserve.pooling.engine import EmbeddingEngine
from jserve.pooling.params import PoolingParams
from jserve.pooling.sentence_transformers import read_pooling_config

__all__ = [
    "DECODER_DEFAULT",
    "EmbeddingEngine",
    "PoolingConfig",
    "PoolingParams",
    "parse_pooler_config",
    "read_pooling_config",
]
