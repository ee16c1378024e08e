"""Engine outputs as OpenAI response bodies: whole responses, and streamed chunks built from deltas.

A choice's index is prompt_index * n + completion index, as OpenAI numbers them. A chunk's text is the
engine's delta (the incremental detokenizer never splits a UTF-8 character, and the engine holds back a
tail that could still become a stop string), so each chunk's text is final.
"""

from __future__ import annotations

import abc
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from jserve.outputs import CompletionOutput, Logprob, RequestOutput, SampleLogprobs
from jserve.tools import StreamDelta, ToolCall, ToolCallDelta, ToolStreamer
from jserve.tools.extract import ToolCalls


@dataclass
class ChoiceProgress:
    """What a streamed choice has sent, and the tokens that wait to go out with the text they complete."""

    text_sent: int = 0  # characters: where the next chunk's text starts in the choice (its text_offset)
    tokens_sent: int = 0
    tokens: list[int] = field(default_factory=list)  # received, their text not yet
    logprobs: SampleLogprobs = field(default_factory=list)  # theirs
    finished: bool = False


class ResponseBuilder(abc.ABC):
    """Shared by both endpoints: ids, usage, and per-choice streaming progress."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, model: str, n: int, top_logprobs: int = 0, echo_texts: list[str] | None = None,
                 prompt_logprobs: bool = False):  # fmt: skip
        """`prompt_logprobs`: the response's `prompt_logprobs` field (vLLM's) holds them; null otherwise."""
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.n, self.top_logprobs = model, n, top_logprobs
        self.echo_texts = echo_texts
        self.prompt_logprobs = prompt_logprobs
        self.progress: dict[int, ChoiceProgress] = {}
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens: dict[int, int] = {}

    def usage(self) -> dict:
        prompt, completion = sum(self.prompt_tokens.values()), sum(self.completion_tokens.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }

    def count_prompts(self, prompt_lengths: list[int]) -> None:
        """The prompts' tokens, known before any output: a stream's usage so far counts them from its start."""
        self.prompt_tokens = dict(enumerate(prompt_lengths))

    def _record(self, prompt_index: int, out: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        self.cached_tokens[prompt_index] = out.num_cached_tokens
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            # the whole completion is in its finished output; each output before it adds its delta
            so_far = self.completion_tokens.get(index, 0) + len(c.delta_token_ids)
            self.completion_tokens[index] = len(c.token_ids) if c.finished else so_far

    def response(self, outputs: list[RequestOutput]) -> dict:
        choices = []
        for prompt_index, out in enumerate(outputs):
            self._record(prompt_index, out)
            for c in out.outputs:
                echo = self.echo_texts[prompt_index] if self.echo_texts else ""
                choices.append(self._choice(prompt_index * self.n + c.index, c, echo, out))
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}  # fmt: skip

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        """Chunks for what `out` adds (its deltas; every output of the call must come here, in order): new
        text, its tokens' logprobs, finish reasons."""
        self._record(prompt_index, out)
        chunks = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            progress = self.progress.setdefault(index, ChoiceProgress())
            if progress.finished:
                continue
            progress.tokens += c.delta_token_ids
            if c.delta_logprobs is not None:
                progress.logprobs += c.delta_logprobs
            if not c.delta and not c.finished:
                continue  # tokens whose text is held back go out with the text they complete
            echo = self.echo_texts[prompt_index] if self.echo_texts else ""
            offset = len(echo) + progress.text_sent  # where this chunk's tokens start in the choice's text
            first = progress.text_sent == 0 and progress.tokens_sent == 0
            text = echo + c.delta if first else c.delta
            logprobs = progress.logprobs if c.delta_logprobs is not None else None
            chunks.append(self._chunk(index, text, progress.tokens, logprobs, c.finish_reason, offset))
            progress.text_sent += len(c.delta)
            progress.tokens_sent += len(progress.tokens)
            progress.tokens, progress.logprobs = [], []
            progress.finished = c.finished
        return chunks

    def usage_chunk(self) -> dict:
        return self._envelope([]) | {"usage": self.usage()}

    def _envelope(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": self.chunk_object_name, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    @abc.abstractmethod
    def _choice(self, index: int, c: CompletionOutput, echo: str, out: RequestOutput) -> dict:
        """One choice of a whole response."""

    @abc.abstractmethod
    def _chunk(self, index, text, tokens, logprobs, finish_reason, offset) -> dict:
        """One streamed chunk: `text` and its `tokens`, whose text starts at `offset` in the choice."""


class CompletionResponses(ResponseBuilder):
    """Completions; with echo the prompt comes first (its tokens scored too when logprobs are asked), and
    with `prompt_only` (max_tokens 0) nothing else: the one token generated is dropped."""

    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, *args, prompt_only: bool = False, decode: Callable[[int], str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompt_only, self.decode = prompt_only, decode

    def _record(self, prompt_index: int, out: RequestOutput) -> None:
        super()._record(prompt_index, out)
        if self.prompt_only:
            for c in out.outputs:
                self.completion_tokens[prompt_index * self.n + c.index] = 0

    def _choice(self, index: int, c: CompletionOutput, echo: str, out: RequestOutput) -> dict:
        text, token_ids, logprobs = c.text, c.token_ids, c.logprobs
        finish_reason, stop_reason = c.finish_reason, c.stop_reason
        if self.prompt_only:
            text, token_ids, logprobs = "", [], [] if logprobs is not None else None
            finish_reason, stop_reason = "length", None
        shape = None
        if logprobs is not None:
            shape = completion_logprobs(token_ids, logprobs, len(echo))
            if self.echo_texts is not None and out.prompt_logprobs is not None:
                prompt = echoed_prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, self.decode)
                shape = {key: prompt[key] + shape[key] for key in shape}
        # vLLM's field, in every choice: null unless asked for
        prompt_logprobs = vllm_prompt_logprobs(out.prompt_logprobs) if self.prompt_logprobs else None
        return {"index": index, "text": echo + text, "logprobs": shape, "finish_reason": finish_reason,
                "stop_reason": stop_reason, "prompt_logprobs": prompt_logprobs}  # fmt: skip

    def _chunk(self, index, text, tokens, logprobs, finish_reason, offset) -> dict:
        lp = completion_logprobs(tokens, logprobs, offset) if logprobs is not None else None
        return self._envelope([{"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}])


class ChatResponses(ResponseBuilder):
    """Chat responses; with tools, each choice's text becomes content and tool calls (streamed: as they settle)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model: str, n: int, top_logprobs: int = 0, tools: ToolCalls | None = None,
                 prompt_logprobs: bool = False):  # fmt: skip
        super().__init__(model, n, top_logprobs, prompt_logprobs=prompt_logprobs)
        self.tools = tools
        self.streamers: dict[int, ToolStreamer] = {}
        self.calls_sent: dict[int, int] = {}  # choice index -> tool calls streamed so far

    def response(self, outputs: list[RequestOutput]) -> dict:
        # vLLM puts prompt_logprobs beside the choices (a chat has one prompt), null unless asked for
        prompt_logprobs = vllm_prompt_logprobs(outputs[0].prompt_logprobs) if self.prompt_logprobs else None
        return super().response(outputs) | {"prompt_logprobs": prompt_logprobs}

    def role_chunk(self, num_prompts: int) -> dict:
        """Chat streams open with the assistant role for every choice."""
        return self._envelope([
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(num_prompts * self.n)
        ])  # fmt: skip

    def _choice(self, index: int, c: CompletionOutput, echo: str, out: RequestOutput) -> dict:
        logprobs = chat_logprobs(c.token_ids, c.logprobs, self.top_logprobs) if c.logprobs is not None else None
        message: dict = {"role": "assistant", "content": c.text}
        finish_reason = c.finish_reason
        if self.tools is not None:
            parsed = self.tools.parse(c.text)
            message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"] = [_tool_call(call) for call in parsed.tool_calls]
                finish_reason = self._called(finish_reason)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": c.stop_reason}  # fmt: skip

    def _chunk(self, index, text, tokens, logprobs, finish_reason, offset) -> dict:
        lp = chat_logprobs(tokens, logprobs, self.top_logprobs) if logprobs is not None else None
        delta: dict = {"content": text} if text else {}
        if self.tools is not None:
            streamer = self.streamers.setdefault(index, self.tools.streamer())
            settled = streamer.feed(text)
            if finish_reason is not None:
                rest = streamer.finish()
                settled = StreamDelta(settled.content + rest.content, settled.tool_calls + rest.tool_calls)
            delta = {"content": settled.content} if settled.content else {}
            if settled.tool_calls:
                delta["tool_calls"] = [_tool_call_delta(d) for d in settled.tool_calls]
                self.calls_sent[index] = self.calls_sent.get(index, 0) + len(settled.tool_calls)
            if finish_reason is not None and self.calls_sent.get(index):
                finish_reason = self._called(finish_reason)
        return self._envelope([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}])

    def _called(self, finish_reason: str) -> str:
        """A choice's finish reason once it made calls: OpenAI's and vLLM's "tool_calls", but for a named
        function, which they end as it ended ("stop")."""
        return finish_reason if self.tools.use.choice.mode == "named" else "tool_calls"


def _tool_call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _tool_call_delta(d: ToolCallDelta) -> dict:
    """OpenAI's streamed call: the first delta of a call names it; later ones append to its arguments."""
    out: dict = {"index": d.index, "function": {"arguments": d.arguments}}
    if d.id is not None:
        out |= {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}
    return out


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], offset: int) -> dict:
    """The legacy completions shape: parallel lists of tokens, their logprobs, top alternatives, text offsets."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token, entry in zip(token_ids, logprobs, strict=True):
        chosen = entry[token]
        tokens.append(chosen.decoded_token)
        token_logprobs.append(chosen.logprob)
        alternatives: dict[str, float] = {}
        for lp in entry.values():  # distinct ids can decode alike (byte pieces); keep the likelier
            alternatives.setdefault(lp.decoded_token, lp.logprob)
        top.append(alternatives)
        offsets.append(offset)
        offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def echoed_prompt_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob] | None], decode: Callable[[int], str]
) -> dict:
    """The prompt's part of an echo's completions logprobs: its first token has no logprob (null)."""
    scored = completion_logprobs(token_ids[1:], logprobs[1:], len(decode(token_ids[0])))
    return {
        "tokens": [decode(token_ids[0]), *scored["tokens"]],
        "token_logprobs": [None, *scored["token_logprobs"]],
        "top_logprobs": [None, *scored["top_logprobs"]],
        "text_offset": [0, *scored["text_offset"]],
    }


def vllm_prompt_logprobs(logprobs: list[dict[int, Logprob] | None] | None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs` choice field: per prompt token, {token id: {logprob, rank, decoded_token}}."""
    if logprobs is None:
        return None

    def item(lp: Logprob) -> dict:
        return {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}

    return [None if entry is None else {str(tid): item(lp) for tid, lp in entry.items()} for entry in logprobs]


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int) -> dict:
    """The chat shape: per token its text, logprob, UTF-8 bytes, and the top_n most likely alternatives."""

    def item(lp: Logprob) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for token, entry in zip(token_ids, logprobs, strict=True):
        top = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_n), key=lambda lp: lp.rank)
        content.append(item(entry[token]) | {"top_logprobs": [item(lp) for lp in top]})
    return {"content": content}
