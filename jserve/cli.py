"""The `jserve` command: generate text with a model, or convert a checkpoint to jserve's Orbax format."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from jserve.errors import JServeError

log = logging.getLogger("jserve")


def cmd_generate(args: argparse.Namespace) -> None:
    from jserve.greedy import iter_greedy
    from jserve.loader import load_model
    from jserve.tokenizer import IncrementalDetokenizer

    model = load_model(args.model, dtype=args.dtype)
    tokenizer = model.tokenizer
    if tokenizer.chat_template and not args.raw:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    detokenizer = IncrementalDetokenizer(tokenizer)
    start, count = time.perf_counter(), 0
    for token in iter_greedy(model, prompt_ids, args.max_tokens):
        count += 1
        sys.stdout.write(detokenizer.add([token]))
        sys.stdout.flush()
    sys.stdout.write(detokenizer.flush() + "\n")
    log.info("%d prompt tokens, %d generated in %.2fs (greedy)", len(prompt_ids), count, time.perf_counter() - start)


def cmd_convert(args: argparse.Namespace) -> None:
    from jserve.loader import load_model

    start = time.perf_counter()
    load_model(args.src, dtype=args.dtype).save_orbax(args.dst)
    log.info("Wrote %s in %.1fs", args.dst, time.perf_counter() - start)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jserve", description="LLM inference on JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="greedy-generate a reply to one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="GGUF file, HF folder or hub id in the local cache, jserve folder "
                     "(default: SmolLM2-135M-Instruct)")  # fmt: skip
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.set_defaults(run=cmd_generate)

    conv = sub.add_parser("convert", help="write a model as a jserve Orbax checkpoint, which loads faster")
    conv.add_argument("src", help="GGUF file, HF folder or jserve folder")
    conv.add_argument("dst", help="new folder to write")
    conv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    conv.set_defaults(run=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)  # jserve's own log only; JAX's backend probing stays quiet
    log.setLevel(logging.INFO)
    try:
        args.run(args)
    except (JServeError, FileExistsError, ValueError) as err:
        log.error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
