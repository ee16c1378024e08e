"""The `jserve` command: generate, chat, and convert checkpoints to jserve's Orbax format."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from jserve.command_line import build_parser
from jserve.config_file import parse_args
from jserve.engine.args import EngineArgs
from jserve.errors import JServeError
from jserve.parallel.distributed import DistributedArgs, is_leader
from jserve.startup import create_engine

log = logging.getLogger("jserve")


def build_llm(args: argparse.Namespace):
    from jserve.llm import LLM

    if getattr(args, "lora", None):
        args.enable_lora = True
    return LLM.from_engine_args(EngineArgs.from_cli_args(args))


def lora_request(args: argparse.Namespace):
    """The adapter `--lora` names (None: the base model)."""
    from jserve.lora import LoRARequest

    return LoRARequest("cli", 1, args.lora) if args.lora else None


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


def stream_reply(llm, prompt_ids: list[int], params, lora=None) -> str:
    start, reply = time.perf_counter(), []
    for delta in llm.stream(prompt_ids, params, lora):
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
        stream_reply(llm, prompt_ids, params, lora_request(args))
    finally:
        llm.close()


def cmd_chat(args: argparse.Namespace) -> None:
    llm, params = build_llm(args), sampling_params(args)
    try:
        chat_loop(llm, params, args.system, lora_request(args))
    finally:
        llm.close()


def chat_loop(llm, params, system: str | None, lora=None) -> None:
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
        reply = stream_reply(llm, prompt_ids, params, lora)
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
        enable_weight_routes=args.enable_weight_routes,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
    )
    return serve(EngineArgs.from_cli_args(args), settings, args.host, args.port, args.shutdown_timeout)


def run_command(args: argparse.Namespace) -> int | None:
    """Run the command; in a multi-host run only process 0 does, and the others mirror its engine."""
    if hasattr(args, "distributed"):
        DistributedArgs.from_cli_args(args).initialize()
        if not is_leader():
            create_engine(EngineArgs.from_cli_args(args)).follow()
            return 0
    commands = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "convert": cmd_convert}
    return commands[args.command](args)


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
