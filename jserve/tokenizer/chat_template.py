"""Rendering Hugging Face chat templates the way transformers does.

Checkpoints ship their prompt format as a Jinja template. Models are trained on
exactly the text transformers renders, so the environment, filters and globals
here mirror it: any difference would change the prompt the model sees.
"""

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    # Templates call this to reject conversations they cannot format.
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which would alter tool schemas.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


def _make_environment() -> ImmutableSandboxedEnvironment:
    # Templates are untrusted code from model repositories, hence the sandbox.
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


_ENVIRONMENT = _make_environment()


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    return _ENVIRONMENT.from_string(source)


def render_chat_template(
    source: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` with the template `source`.

    `special_tokens` maps names such as "bos_token" to their strings; only the
    tokens the checkpoint defines are passed, so `is defined` tests behave.
    Extra keyword arguments (e.g. `enable_thinking`) reach the template as-is
    and override special tokens of the same name.
    """
    # OpenAI-style clients send `content: null` or `tool_calls: null`; templates
    # handle a missing key but often print "None", so such keys are dropped.
    cleaned = [{key: value for key, value in message.items() if value is not None} for message in messages]
    template = _compile(source)
    try:
        return template.render(
            messages=cleaned,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**special_tokens, **kwargs},
        )
    except jinja2.TemplateError as err:  # raise_exception, or the sandbox refusing what the messages led to
        raise ValueError(f"the chat template cannot render these messages: {err}") from err
