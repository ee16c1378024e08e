"""jserve: an LLM inference engine on JAX."""

from jserve.config_file import load_config
from jserve.llm import LLM, generate
from jserve.lora import LoRARequest
from jserve.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from jserve.pooling import PoolingParams
from jserve.sampling_params import SamplingParams
from jserve.structured import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "generate",
    "load_config",
]
