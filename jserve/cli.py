"""The `jserve` command: generate, chat, and convert checkpoints to jserve's Orbax format."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from jserve.config_file import parse_args
from jserve.engine.args import DTYPES, EngineArgs
from jserve.errors import JServeError
from jserve.parallel.distributed import DistributedArgs, is_leader
from jserve.tools import TOOL_PARSERS

log = logging.getLogger("jserve")


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


def build_llm(args: argparse.Namespace):
    from jserve.llm import LLM

    return LLM.from_engine_args(EngineArgs.from_cli_args(args))


def sampling_params(args: argparse.Namespace):
    from jserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
    )


def stream_reply(llm, prompt_ids: list[int], params) -> str:
    start, reply = time.perf_counter(), []
    for delta in llm.stream(prompt_ids, params):
        reply.append(delta)
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    text = "".join(reply)
    log.info(
        "%d prompt tokens, reply of %d characters in %.2fs", len(prompt_ids), len(text), time.perf_counter() - start
    )
    return text


def cmd_generate(args: argparse.Namespace) -> None:
    llm, params = build_llm(args), sampling_params(args)
    tokenizer = llm.get_tokenizer()
    if tokenizer.chat_template and not args.raw:
        _, prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    try:
        stream_reply(llm, prompt_ids, params)
    finally:
        llm.close()


def cmd_chat(args: argparse.Namespace) -> None:
    llm, params = build_llm(args), sampling_params(args)
    try:
        chat_loop(llm, params, args.system)
    finally:
        llm.close()


def chat_loop(llm, params, system: str | None) -> None:
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "system", "content": system}] if system else []
    print("Chat with the model; an empty line or Ctrl-D ends it.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        _, prompt_ids = tokenizer.encode_chat(messages)
        reply = stream_reply(llm, prompt_ids, params)
        messages.append({"role": "assistant", "content": reply})


def cmd_convert(args: argparse.Namespace) -> None:
    from jserve.loader import load_model

    start = time.perf_counter()
    load_model(args.src, dtype=args.dtype).save_orbax(args.dst)
    log.info("Wrote %s in %.1fs", args.dst, time.perf_counter() - start)


def cmd_serve(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from jserve.loader.default_model import DEFAULT_MODEL_NAME
    from jserve.server import ServerSettings, serve

    template = args.chat_template
    if template is not None and Path(template).is_file():
        template = Path(template).read_text()
    settings = ServerSettings(
        served_model_name=args.served_model_name or (str(args.model) if args.model else DEFAULT_MODEL_NAME),
        api_key=args.api_key or os.environ.get("JSERVE_API_KEY"),
        max_queue=args.max_queue,
        chat_template=template,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
    )
    return serve(EngineArgs.from_cli_args(args), settings, args.host, args.port, args.shutdown_timeout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jserve", description="LLM inference on JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="reply to one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    for add in (EngineArgs.add_cli_args, DistributedArgs.add_cli_args, add_sampling_args):
        add(gen)
    gen.set_defaults(run=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    for add in (EngineArgs.add_cli_args, DistributedArgs.add_cli_args, add_sampling_args):
        add(chat)
    chat.set_defaults(run=cmd_chat)

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
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds a stop signal waits for requests in flight before aborting them")  # fmt: skip
    EngineArgs.add_cli_args(srv, positional_model=True)
    DistributedArgs.add_cli_args(srv)
    srv.set_defaults(run=cmd_serve)

    for command in (gen, chat, srv):
        command.add_argument("--config", default=None, metavar="FILE.yaml",
                             help="settings as `flag-name: value` lines (configs/ has presets); flags given on "
                             "the command line override the file's")  # fmt: skip

    conv = sub.add_parser("convert", help="write a model as a jserve Orbax checkpoint, which loads faster")
    conv.add_argument("src", help="GGUF file, HF folder or jserve folder")
    conv.add_argument("dst", help="new folder to write")
    conv.add_argument("--dtype", default="auto", choices=DTYPES)
    conv.set_defaults(run=cmd_convert)
    return parser


def run_command(args: argparse.Namespace) -> int | None:
    """Run the command; in a multi-host run only process 0 does, and the others mirror its engine."""
    if hasattr(args, "distributed"):
        DistributedArgs.from_cli_args(args).initialize()
        if not is_leader():
            EngineArgs.from_cli_args(args).create_engine().follow()
            return 0
    return args.run(args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    # One root handler (replacing any a library set up, so no line prints twice); INFO for jserve's own
    # log only, so JAX's backend probing stays quiet.
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING, force=True)
    log.setLevel(logging.INFO)
    try:
        code = run_command(args)
    except (JServeError, FileExistsError, ValueError) as err:
        log.error("%s", err)
        return 1
    except KeyboardInterrupt:
        return 130
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
