"""Tokenizers for jserve: Hugging Face folders and GGUF files, chat templates, streaming."""

from jserve.tokenizer.detokenizer import IncrementalDetokenizer, incremental_detokenizer
from jserve.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "incremental_detokenizer"]
