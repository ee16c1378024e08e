"""The Python API: `LLM` for batches, chat and streaming, and `generate()` for notebooks."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jserve.engine.args import EngineArgs
from jserve.heap import frozen_heap
from jserve.loader.weight_export import model_weights
from jserve.loader.weight_update import Weights, updated_params
from jserve.lora import LoRARequest
from jserve.outputs import EmbeddingRequestOutput, RequestOutput
from jserve.pooling import EmbeddingEngine, PoolingParams
from jserve.pooling.inputs import embedding_input, prompt_text
from jserve.pooling.vectors import pair_scores
from jserve.sampling_params import SamplingParams
from jserve.setting import build
from jserve.startup import create_engine
from jserve.tools import get_tool_parser
from jserve.tools.chat_tools import ChatTools
from jserve.tools.extract import ToolCalls
from jserve.tools.spec import parse_tool_use

Prompt = str | list[int]
# an input to embed: text, token ids, or vLLM's {"prompt_token_ids": [...]}
EmbedInput = str | list[int] | dict
Messages = list[dict]
PromptIds = tuple[str | None, list[int]]  # a prompt's text (None for token ids given as such) and its ids


class LLM:
    """A model with its engine. `LLM()` serves the default model, SmolLM2-135M-Instruct."""

    def __init__(self, model: str | os.PathLike | None = None, **settings: Any):
        """`model`: a GGUF file, a Hugging Face or jserve folder, or a hub id (default: SmolLM2-135M-Instruct).
        `settings`: the fields of `EngineArgs` (jserve/engine/args.py, each with its help; `jserve serve --help`
        prints them), explained with their trade-offs in docs/configuration.md. A name that is no setting is a
        TypeError suggesting the closest one."""
        self._start(build(EngineArgs, model=model, **settings))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        """An LLM from settings gathered already, as the commands gather them from their flags."""
        llm = cls.__new__(cls)
        llm._start(args)
        return llm

    def _start(self, args: EngineArgs) -> None:
        self.engine = create_engine(args, progress_bars=True)
        self.tokenizer = self.engine.tokenizer

    @property
    def embeds(self) -> bool:
        """Whether this is an embedding model (task embed: `embed` and `score`, not `generate`)."""
        return isinstance(self.engine, EmbeddingEngine)

    def get_tokenizer(self):
        return self.tokenizer

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter and serve it by name (LoRARequest(name) finds it) until remove_lora."""
        self._adapters().register(lora_request.lora_name, lora_request.lora_path, lora_request.lora_int_id or None)

    def remove_lora(self, name: str) -> None:
        """Stop serving an adapter by name (requests already queued with it still run with it)."""
        self._adapters().unregister(name)

    def list_loras(self) -> list[str]:
        return [adapter.name for adapter in self._adapters()]

    def _adapters(self):
        adapters = self._generator().adapters
        if adapters is None:
            raise ValueError("this engine serves no LoRA adapters: create it with enable_lora=True")
        return adapters

    def update_weights(self, weights: Weights, *, names: str = "hf") -> None:
        """Serve new weights from now on, without reloading or compiling (e.g. after a training step).

        `weights`: a Flax NNX model or nnx.State of this architecture, a mapping of names to arrays (any subset
        of the model's tensors: the rest keep their values), or a Hugging Face / `jserve convert` folder.
        `names`: "hf" for checkpoint names (`model.layers.0.self_attn.q_proj.weight`, as transformers'
        state_dict has them), "jserve" for the engine's own (as get_weights(names="jserve") returns them:
        fused q/k/v and gate/up, int8 where the engine quantized). Arrays on the engine's devices with its
        dtype and sharding are used as they are, without a copy; others are cast and placed, and float
        weights for an int8 engine quantized. A tensor that names no parameter or has another shape is a
        WeightUpdateError (a ValueError) naming it, and the old weights keep serving.

        Requests already running (a stream not yet read to its end) finish on the weights they started
        with; the new ones take over as soon as none is left, before any later request starts. Cached
        prompt prefixes are dropped then. Outputs say which weights produced them (`weights_version`)."""
        engine = self._generator()
        engine.update_weights(updated_params(engine.model, weights, names))

    def get_weights(self, names: str = "hf") -> dict:
        """The weights the engine serves, by name: "hf" as a Hugging Face checkpoint holds them (host arrays,
        float engines only), "jserve" the engine's own arrays as they are (no copy: hand them, or arrays
        like them, back to update_weights). A trainer that donates these arrays to its own jitted update
        deletes them under the engine: update the weights again before generating."""
        self._generator().weights.check_held()
        return model_weights(self.engine.model, names)

    def sleep(self, level: int = 1) -> None:
        """Hand device memory back while the trainer runs: level 1 frees the KV cache, level 2 also lets go of
        the weights (after wake_up, update_weights must bring new ones before generating). Generating while
        asleep is an EngineAsleepError; wake_up() serves again without compiling anything."""
        self._generator().sleep(level)

    def wake_up(self) -> None:
        self._generator().wake_up()

    @property
    def is_sleeping(self) -> bool:
        return self._generator().weights.sleeping

    def close(self) -> None:
        """Multi-host runs (docs/scale-out.md): on process 0, release the followers when done; a no-op on one
        host. On every other process, call `follow()` instead of generating."""
        self.engine.close()

    def follow(self) -> None:
        """Multi-host runs, processes other than 0: mirror process 0's steps until it calls `close()`."""
        self.engine.follow()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (a str, a list of str, or a list of token-id lists); outputs in input order.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model; the engine
        needs enable_lora=True)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        return self._run([self._encode(p) for p in prompts], sampling_params, use_tqdm, priority, lora_request)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
        tool_parser: str = "hermes",
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of messages) or to each of several, with the chat template.

        With `tools` (OpenAI's format), each finished completion's `tool_calls` holds the calls the model made
        (read by `tool_parser`, or, for tool_choice "required" or a named function, generated under a grammar
        of the tools' schemas) and its `text` the content around them. A forced call's grammar cannot be
        combined with sampling params' own structured_outputs: a ValueError, as the server answers a 400."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        options = {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls}
        use = parse_tool_use({key: value for key, value in options.items() if value is not None})
        chat = ChatTools(use, self.tokenizer.chat_template)
        prompts = []
        for conversation in conversations:
            rendered, template_tools = chat.template_inputs(list(conversation))
            prompts.append(self.tokenizer.encode_chat(rendered, add_generation_prompt, tools=template_tools))
        params = [replace(p, structured_outputs=chat.constraint(p.structured_outputs))
                  for p in _per_prompt(sampling_params, len(prompts))]  # fmt: skip
        outputs = self._run(prompts, params, use_tqdm, None, lora_request)
        if use is None:
            return outputs
        calls = ToolCalls(use, get_tool_parser(tool_parser))
        for out in outputs:
            for i, c in enumerate(out.outputs):
                parsed = calls.parse(c.text)
                out.outputs[i] = replace(c, text=parsed.content or "", tool_calls=parsed.tool_calls)
        return outputs

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, lora_request: LoRARequest | None = None
    ) -> Iterator[str]:
        """Yield the completion's text as it is generated (one completion: n must be 1)."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"stream produces one completion; got n={params.n}")
        text, ids = self._encode(prompt)
        request_id = self._generator().add_request(ids, params, prompt_text=text, lora_request=lora_request)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    if delta := out.outputs[0].delta:
                        yield delta
                    if out.finished:
                        return
        finally:
            self.engine.abort_request(request_id)  # no-op once finished; frees the pages if the caller stopped early

    def embed(
        self,
        inputs: EmbedInput | Sequence[EmbedInput],
        *,
        prompt_name: str | None = None,
        dimensions: int | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per input (an embedding model), in input order: `outputs.embedding` of each.

        `inputs`: a text, token ids, vLLM's {"prompt_token_ids": ids}, or a list of them. Texts are tokenized
        with the checkpoint's special tokens, as sentence-transformers does, after its prompt `prompt_name`
        (one of the model's named prompts, e.g. "query"; default: the model's default prompt, if any) is put
        before them. `dimensions`: cut each vector to its first so many values, normalized again if the model
        normalizes (matryoshka models only)."""
        engine = self._embedder()
        params = PoolingParams(dimensions)
        one = isinstance(inputs, str | dict) or (len(inputs) > 0 and isinstance(inputs[0], int | np.integer))
        items = [inputs] if one else list(inputs)
        prefix = prompt_text(engine.pooling, prompt_name)
        prompts = [self._embedding_ids(item, prefix) for item in items]
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        ids: list[str] = []
        try:
            for (text, prompt_ids), prio in zip(prompts, priorities, strict=True):
                ids.append(engine.add_request(prompt_ids, params, priority=prio, prompt_text=text))
            return self._drain(ids, use_tqdm, "Embedding")
        except BaseException:  # a bad input, or Ctrl-C: withdraw this batch, leave the engine usable
            for request_id in ids:
                engine.abort_request(request_id)
            raise

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], **embed_options) -> list[float]:
        """The cosine similarity of each pair of texts (one against many, or pairwise: lists of one length), as
        vLLM's score for embedding models."""
        left = [text_1] if isinstance(text_1, str) else list(text_1)
        right = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(left) != 1 and len(left) != len(right):
            raise ValueError(f"score pairs texts: got {len(left)} and {len(right)} (one against many, or as many)")
        return pair_scores([o.outputs.embedding for o in self.embed(left + right, **embed_options)], len(left))

    def _embedder(self) -> EmbeddingEngine:
        if not self.embeds:
            raise ValueError("this model generates text: embed an input with an embedding model (a checkpoint with "
                             "sentence-transformers pooling files, or LLM(model, task='embed'))")  # fmt: skip
        return self.engine

    def _generator(self):
        if self.embeds:
            raise ValueError("this is an embedding model (task embed): it makes vectors with LLM.embed, not text")
        return self.engine

    def _embedding_ids(self, item: EmbedInput, prefix: str) -> PromptIds:
        if isinstance(item, dict):
            if set(item) != {"prompt_token_ids"}:
                raise ValueError(f"an input given as a dict has one key, prompt_token_ids; got {sorted(item)}")
            return None, list(item["prompt_token_ids"])
        if isinstance(item, str):
            return embedding_input(self.tokenizer, self.engine.pooling, item, prefix)
        return None, list(item)

    def _encode(self, prompt: Prompt) -> PromptIds:
        """A prompt's ids: text is encoded here (with the checkpoint's BOS/EOS rules), as the engine takes ids."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def _run(
        self, prompts: list[PromptIds], sampling_params, use_tqdm, priority, lora_request=None
    ) -> list[RequestOutput]:
        self._generator()
        params = _per_prompt(sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        adapters = _per_prompt_adapter(lora_request, len(prompts))
        ids: list[str] = []
        try:
            for (text, prompt_ids), p, prio, adapter in zip(prompts, params, priorities, adapters, strict=True):
                ids.append(self.engine.add_request(prompt_ids, p, priority=prio, prompt_text=text, stream=False,
                                                   lora_request=adapter))  # fmt: skip
            return self._drain(ids, use_tqdm)
        except BaseException:  # a bad prompt, or Ctrl-C: withdraw this batch, leave the engine usable
            for request_id in ids:
                self.engine.abort_request(request_id)
            self.engine.step()  # hand the aborted requests' pages back now
            raise

    def _drain(self, ids: list[str], use_tqdm: bool, what: str = "Generating") -> list:
        """Step the engine until these requests finish; their outputs in order. The bar shows output tokens per
        second, or input tokens per second for an embedding model."""
        pending = set(ids)
        done: dict = {}
        bar = tqdm(total=len(ids), desc=what, unit="req", disable=not use_tqdm)
        start, tokens = time.perf_counter(), 0
        with frozen_heap():  # no full garbage collection pausing the loop (jserve/heap.py)
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending and out.finished:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        if isinstance(out, EmbeddingRequestOutput):
                            tokens += len(out.prompt_token_ids)
                            rate = {"in_tok_s": f"{tokens / (time.perf_counter() - start):.1f}"}
                        else:
                            tokens += sum(len(c.token_ids) for c in out.outputs)
                            rate = {"out_tok_s": f"{tokens / (time.perf_counter() - start):.1f}"}
                        bar.update(1)
                        bar.set_postfix(rate)
        bar.close()
        return [done[i] for i in ids]


def _per_prompt(sampling_params, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt, from None (the defaults), one for all, or one each."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
    return params


def _per_prompt_adapter(lora_request, count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    adapters = list(lora_request)
    if len(adapters) != count:
        raise ValueError(f"got {len(adapters)} lora_requests for {count} prompts")
    return adapters


_engines: dict[str, LLM] = {}


def generate(
    prompt_or_prompts: str | Sequence[str], model: str | None = None, chat: bool | None = None, **sampling_kwargs
) -> str | list[str]:
    """The notebook one-liner: reply to a prompt (or each of a list) with a lazily created, reused engine.

    Greedy and up to 256 tokens unless sampling_kwargs say otherwise; instruct models (those with a chat
    template) get the prompt as a user message unless chat=False.
    """
    key = str(model)
    if key not in _engines:
        _engines[key] = LLM(model)
    llm = _engines[key]
    sampling_kwargs.setdefault("temperature", 0.0)
    sampling_kwargs.setdefault("max_tokens", 256)
    params = SamplingParams(**sampling_kwargs)
    prompts = [prompt_or_prompts] if isinstance(prompt_or_prompts, str) else list(prompt_or_prompts)
    use_chat = llm.tokenizer.chat_template is not None if chat is None else chat
    if use_chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 1)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    texts = [o.outputs[0].text for o in outputs]
    return texts[0] if isinstance(prompt_or_prompts, str) else texts
