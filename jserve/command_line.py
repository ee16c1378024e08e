"""The `jserve` command's flags: one subcommand each for generate, chat, serve and convert (cli.py runs them;
config files take the same keys)."""

from __future__ import annotations

import argparse

from jserve.engine.args import DTYPES, EngineArgs
from jserve.parallel.distributed import DistributedArgs
from jserve.tools import TOOL_PARSERS


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def add_lora_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lora", default=None, metavar="PATH", help="reply with this LoRA adapter (a PEFT folder or hub id)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jserve", description="LLM inference on JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="reply to one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    for add in (EngineArgs.add_cli_args, DistributedArgs.add_cli_args, add_sampling_args, add_lora_arg):
        add(gen)

    chat = sub.add_parser("chat", help="an interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    for add in (EngineArgs.add_cli_args, DistributedArgs.add_cli_args, add_sampling_args, add_lora_arg):
        add(chat)

    srv = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set JSERVE_API_KEY)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    srv.add_argument("--max-queue", type=int, default=1024, help="waiting requests beyond which new ones get 429")
    srv.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    srv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    srv.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                     help="the format the model writes tool calls in: hermes (Qwen2.5, Hermes, jserve's generic "
                     "tool prompt), llama3_json (Llama 3.1+), mistral, pythonic (Llama 4, Llama 3.2)")  # fmt: skip
    srv.add_argument("--enable-weight-routes", action="store_true",
                     help="serve POST /v1/update_weights (a checkpoint folder), POST /sleep, POST /wake_up and "
                     "GET /is_sleeping, for a trainer in another process (behind --api-key if one is set)")  # fmt: skip
    srv.add_argument("--allow-runtime-lora-updating", action="store_true",
                     help="serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora; "
                     "behind --api-key if one is set)")  # fmt: skip
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds a stop signal waits for requests in flight before aborting them")  # fmt: skip
    EngineArgs.add_cli_args(srv, positional_model=True)
    DistributedArgs.add_cli_args(srv)

    for command in (gen, chat, srv):
        command.add_argument("--config", default=None, metavar="FILE.yaml",
                             help="settings as `flag-name: value` lines (configs/ has presets); flags given on "
                             "the command line override the file's")  # fmt: skip

    conv = sub.add_parser("convert", help="write a model as a jserve Orbax checkpoint, which loads faster")
    conv.add_argument("src", help="GGUF file, HF folder or jserve folder")
    conv.add_argument("dst", help="new folder to write")
    conv.add_argument("--dtype", default="auto", choices=DTYPES)
    return parser
