"""Read OpenAI request bodies into what the engine takes, refusing every parameter jserve would ignore.

A parameter set to null counts as not given (OpenAI's own reading). Any other parameter outside the
lists below gets a 400 naming it, so a client never believes it got a feature it did not.
"""

from __future__ import annotations

from dataclasses import dataclass

from jserve.errors import RequestError, short_repr
from jserve.sampling_params import MAX_LOGPROBS, SamplingParams
from jserve.server.errors import bad_request
from jserve.server.response_format import parse_structured_outputs
from jserve.tools.spec import ToolUse, parse_tool_use

# Parameters both endpoints take, mapped onto SamplingParams fields of the same name.
SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos", "logit_bias", "skip_special_tokens",
    "prompt_logprobs",
)  # fmt: skip
COMMON_FIELDS = {"model", "max_tokens", "stream", "stream_options", "user", "priority", "cache_salt",
                 "response_format", "structured_outputs", *SAMPLING_FIELDS}  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt",
                               "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"}  # fmt: skip
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
MAX_PROMPTS = 1024  # prompts in one completions request (each is tokenized before the queue limit applies)


Prompt = str | list[int]


@dataclass
class GenerationRequest:
    """One /v1/completions or /v1/chat/completions call, validated."""

    model: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool  # stream_options.continuous_usage_stats: the usage so far on every chunk
    priority: int
    cache_salt: str | None = None  # requests share cached prefixes only within one salt
    prompts: list[Prompt] | None = None  # completions
    echo: bool = False
    messages: list[dict] | None = None  # chat
    add_generation_prompt: bool = True
    max_tokens_param: str = "max_tokens"  # the name the client gave it, for errors
    prompt_only: bool = False  # completions with max_tokens 0 and echo: the prompt's scores, nothing generated
    return_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field was given: the response carries them
    structured_param: str = "structured_outputs"  # where the client put its output constraint, for errors
    tool_use: ToolUse | None = None  # chat: the tools offered and how they may be used

    @property
    def num_prompts(self) -> int:
        return len(self.prompts) if self.prompts is not None else 1


def parse_completion(body: dict) -> GenerationRequest:
    body = _given(body, COMPLETION_FIELDS)
    suffix = body.get("suffix", "")
    if not isinstance(suffix, str):
        raise bad_request(f"suffix must be a string, got {short_repr(suffix)}", "suffix")
    if suffix:  # "" asks for no suffix, as null does
        raise bad_request("suffix is not supported", "suffix")
    logprobs = body.get("logprobs")
    echo = _flag(body, "echo")
    max_tokens = body.get("max_tokens", 16)
    prompt_only = max_tokens == 0 and not isinstance(max_tokens, bool)
    if prompt_only and not echo:
        raise bad_request("max_tokens 0 returns only the prompt: it needs echo", "max_tokens")
    if echo and logprobs is not None and body.get("stream"):
        raise bad_request("streaming echo with logprobs is not supported; ask without stream", "stream")
    asked_prompt_logprobs = "prompt_logprobs" in body
    if echo and logprobs is not None and not asked_prompt_logprobs:  # the echoed prompt's tokens are scored
        body = body | {"prompt_logprobs": logprobs}
    # nothing is generated for max_tokens 0: one token is, and dropped from the response
    request = _common(body, logprobs=logprobs, max_tokens=1 if prompt_only else max_tokens)
    request.prompts = _prompts(body.get("prompt"))
    request.echo = echo
    request.prompt_only = prompt_only
    request.return_prompt_logprobs = asked_prompt_logprobs
    best_of = body.get("best_of")
    if best_of is not None and best_of != request.params.n:
        raise bad_request(
            f"best_of must equal n ({request.params.n}); ranking extra samples is not supported", "best_of"
        )
    return request


def parse_chat(body: dict) -> GenerationRequest:
    body = _given(body, CHAT_FIELDS)
    top_logprobs = body.get("top_logprobs")
    wants_logprobs = _flag(body, "logprobs")
    if top_logprobs is not None and not wants_logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    logprobs = (top_logprobs or 0) if wants_logprobs else None
    max_tokens_param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    request = _common(body, logprobs=logprobs, max_tokens=body.get(max_tokens_param))
    request.messages = _messages(body.get("messages"))
    try:
        request.tool_use = parse_tool_use(body)
    except RequestError as err:
        raise bad_request(str(err), err.param) from None
    request.add_generation_prompt = _flag(body, "add_generation_prompt", default=True)
    request.max_tokens_param = max_tokens_param
    return request


@dataclass
class TokenizeRequest:
    model: str | None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[dict] | None = None
    add_generation_prompt: bool = True


def parse_tokenize(body: dict) -> TokenizeRequest:
    """vLLM's /tokenize: a prompt string, or chat messages rendered with the chat template."""
    body = _given(body, {"model", "prompt", "add_special_tokens", "messages", "add_generation_prompt"})
    request = TokenizeRequest(_model(body))
    if "messages" in body:
        request.messages = _messages(body["messages"])
        request.add_generation_prompt = _flag(body, "add_generation_prompt", default=True)
    elif isinstance(body.get("prompt"), str):
        request.prompt = body["prompt"]
        request.add_special_tokens = _flag(body, "add_special_tokens", default=True)
    else:
        raise bad_request("tokenize takes a prompt string or chat messages", "prompt")
    return request


def _given(body: object, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    given = {key: value for key, value in body.items() if value is not None}
    unsupported = sorted(set(given) - allowed)
    if unsupported:
        raise bad_request(f"unsupported parameter(s): {short_repr(unsupported)}", unsupported[0][:60])
    return given


def _common(body: dict, logprobs: object, max_tokens: object) -> GenerationRequest:
    if isinstance(logprobs, int) and not isinstance(logprobs, bool) and logprobs > MAX_LOGPROBS:
        raise bad_request(f"at most {MAX_LOGPROBS} logprobs per token are returned, got {logprobs}", "logprobs")
    sampling = {name: body[name] for name in SAMPLING_FIELDS if name in body}
    structured = parse_structured_outputs(body)
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured, **sampling)
    except RequestError as err:
        raise bad_request(str(err), err.param) from None
    stream = _flag(body, "stream")
    if stream and "prompt_logprobs" in body:  # as vLLM: a stream's chunks have no place for them
        raise bad_request("prompt_logprobs are not available when streaming; ask without stream", "prompt_logprobs")
    options = body.get("stream_options")
    include_usage = continuous_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict) or set(options) - set(STREAM_OPTIONS):
            raise bad_request(f"stream_options takes only {' and '.join(STREAM_OPTIONS)}", "stream_options")
        if not all(isinstance(options.get(name, False), bool) for name in STREAM_OPTIONS):
            raise bad_request(f"stream_options: {' and '.join(STREAM_OPTIONS)} must be booleans, got "
                              f"{short_repr(options)}", "stream_options")  # fmt: skip
        include_usage = options.get("include_usage", False)
        continuous_usage = options.get("continuous_usage_stats", False)
    model = _model(body)
    if not isinstance(body.get("user", ""), str):  # accepted as OpenAI accepts it; jserve does not use it
        raise bad_request("user must be a string", "user")
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise bad_request("priority must be an integer", "priority")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("cache_salt must be a non-empty string", "cache_salt")
    request = GenerationRequest(model, params, stream, include_usage, continuous_usage, priority, salt)
    request.return_prompt_logprobs = "prompt_logprobs" in body
    if "response_format" in body:
        request.structured_param = "response_format"
    return request


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    return model


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {short_repr(value)}", name)
    return value


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(prompt: object) -> list[Prompt]:
    """str, list of str, token ids, or list of token-id lists."""
    prompts = None
    if isinstance(prompt, str) or _is_token_ids(prompt) and prompt:
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt):
            prompts = list(prompt)
    if prompts is not None:
        if not all(prompts):
            raise bad_request("prompt is empty", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise bad_request(f"a request takes at most {MAX_PROMPTS} prompts, got {len(prompts)}", "prompt")
        return prompts
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids, or a list of such lists", "prompt"
    )


def _messages(messages: object) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    return [_message(message, i) for i, message in enumerate(messages)]


def _message(message: object, i: int) -> dict:
    if not isinstance(message, dict):
        raise bad_request(f"messages[{i}] must be an object", "messages")
    # Fields read below; any other is ignored, as vLLM ignores it: clients and agent frameworks send their own
    # (ids, reasoning_content, the openai client's null refusal and audio). A legacy function_call is a call
    # the conversation would lose, so it is refused.
    message = {key: value for key, value in message.items() if value is not None}
    if "function_call" in message:
        raise bad_request(f"messages[{i}]: function_call is not supported; give calls as tool_calls", "messages")
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise bad_request(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {short_repr(role)}", "messages")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and role != "assistant":
        raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls", "messages")
    # An assistant turn that only calls tools has no content; every other turn has some.
    content = "" if "content" not in message and tool_calls else _content(message.get("content"), i)
    rendered = {"role": "system" if role == "developer" else role, "content": content}
    name = message.get("name")
    if name is not None:  # the participant's name: the chat template may show it (transformers passes it)
        if not isinstance(name, str):
            raise bad_request(f"messages[{i}].name must be a string", "messages")
        rendered["name"] = name
    if tool_calls is not None:
        rendered["tool_calls"] = _tool_calls(tool_calls, i)
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise bad_request(f"messages[{i}]: a tool message needs the tool_call_id it answers", "messages")
        rendered["tool_call_id"] = message["tool_call_id"]
    return rendered


def _tool_calls(calls: object, i: int) -> list[dict]:
    """An assistant message's calls, as the client sent them back: id, type "function", name, arguments text."""
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
            or not isinstance(call.get("id", ""), str)
        ):
            raise bad_request(
                f"messages[{i}].tool_calls: each call must be {{'id': str, 'type': 'function', 'function': "
                f"{{'name': str, 'arguments': str}}}}, got {short_repr(call)}",
                "messages",
            )
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": function["name"], "arguments": function["arguments"]}})  # fmt: skip
    return out


def _content(content: object, i: int) -> str:
    """A string, or a list of text parts joined as one string."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"messages[{i}].content: only text parts are supported, got {short_repr(part)}", "messages"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
