"""GrammarCompiler: a constraint -> a compiled grammar, cached by (kind, spec), safe to call from any thread.

Compiling a grammar (llguidance builds its lexer over the whole vocabulary) takes from well under a
millisecond to, for a large schema, a second; so the server compiles on a worker thread before it queues
a request, and the engine thread later finds the result in the cache. A key that is being compiled is
waited for, not compiled twice. A refused constraint is cached too, with its error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass

import llguidance as llg

from jserve.errors import RequestError
from jserve.structured.grammar import grammar_text
from jserve.structured.matcher import GrammarMatcher
from jserve.structured.params import PARAM, StructuredOutputsParams
from jserve.structured.vocabulary import grammar_tokenizer
from jserve.tokenizer import Tokenizer

log = logging.getLogger("jserve")

CACHE_SIZE = 512  # compiled grammars kept (each holds its lexer: kilobytes to a few megabytes)
SLOW_COMPILE_S = 0.1  # compilations slower than this are logged at INFO


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar ready to match: each request takes a fresh matcher copied from the compiled one."""

    template: llg.LLMatcher

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.template.deep_copy())


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Collection[int]):
        self._source = (tokenizer, vocab_size, frozenset(eos_ids))
        self._tokenizer: llg.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future[CompiledGrammar]] = OrderedDict()
        self.hits = self.misses = 0

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        """The grammar engine's tokenizer, built on first use (~0.2 s for a 49k vocabulary)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = grammar_tokenizer(*self._source)
            return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `params`; raises RequestError if it is not a valid constraint."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            owner = future is None
            if owner:
                future = self._cache[key] = Future()
                self.misses += 1
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self.hits += 1
                self._cache.move_to_end(key)
        if owner:
            try:
                future.set_result(self._build(params))
            except Exception as error:
                future.set_exception(error)
        return future.result()

    def _build(self, params: StructuredOutputsParams) -> CompiledGrammar:
        tokenizer = self.tokenizer
        start = time.perf_counter()
        grammar = grammar_text(params)
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"structured outputs: invalid {params.kind}: {matcher.get_error().strip()}", PARAM)
        elapsed = time.perf_counter() - start
        log.log(logging.INFO if elapsed > SLOW_COMPILE_S else logging.DEBUG, "Compiled a %s grammar (%d characters) in "
                "%.1f ms; %d cached", params.kind, len(params.spec), elapsed * 1e3, len(self._cache))  # fmt: skip
        return CompiledGrammar(matcher)
