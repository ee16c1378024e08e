"""Process 0 of a multi-host run on host CPU devices: joins the run, generates through the LLM API with the
engine flags it is given (the followers get the same flags through `jserve generate`), prints JSON tokens.

    python tests/multihost_worker.py PROMPTS_JSON [engine flags] [multi-host flags]
"""

from __future__ import annotations

import argparse
import json

from jserve import LLM, SamplingParams
from jserve.engine.args import EngineArgs
from jserve.parallel.distributed import DistributedArgs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("prompts")
    EngineArgs.add_cli_args(parser)
    DistributedArgs.add_cli_args(parser)
    args = parser.parse_args()
    DistributedArgs.from_cli_args(args).initialize()
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    outputs = llm.generate(
        json.loads(args.prompts), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    llm.close()
    # On a line of its own: gloo prints to stdout too.
    print("\n" + json.dumps({"tokens": [o.outputs[0].token_ids for o in outputs],
                             "cached": [o.num_cached_tokens for o in outputs]}))  # fmt: skip


if __name__ == "__main__":
    main()
