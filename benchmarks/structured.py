"""Structured outputs: a JSON-schema workload against the same prompts unconstrained, in one run.

Chat prompts ask for data matching one of 8 schemas (a person record, a product with price bounds and an
enum category, a shopping list with minItems / maxItems, a company with a nested address, ...); the schema
is in the prompt and, for the constrained run, in `structured_outputs`. Greedy. Each repeat, at each
concurrency (1: one request per call; C: all requests in one call, max_num_seqs C), runs the requests
constrained, then unconstrained with ignore_eos and max_tokens = the tokens each request emitted
constrained, so both runs emit the same tokens, then constrained again with every grammar row sampled inside
its step ("waiting": the step waits for the one before it, as when the rows cannot be sampled after launch).
Prints output tok/s medians and their ratios to unconstrained, host ms per constrained step spent filling
token bitmasks (p50 / p99), schema compile ms (cold: a schema
never seen; cached: the same again), and whether each output that finished "stop" is JSON valid under its
schema.

    python benchmarks/structured.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema
import numpy as np

from jserve import LLM, SamplingParams, StructuredOutputsParams

NAME = {"type": "string", "minLength": 1, "maxLength": 40}
SCHEMAS = [  # (schema, request, two subjects)
    ({"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
      "email": {"type": "string", "maxLength": 60}, "is_member": {"type": "boolean"}},
      "required": ["name", "age", "email", "is_member"], "additionalProperties": False},
     "Create a customer record for {}.", ["a retired pilot from Lisbon", "a student who loves chess"]),
    ({"type": "object", "properties": {"name": NAME, "price": {"type": "number", "minimum": 0, "maximum": 10000},
      "category": {"enum": ["electronics", "books", "clothing", "home", "toys"]}, "in_stock": {"type": "boolean"}},
      "required": ["name", "price", "category", "in_stock"], "additionalProperties": False},
     "Describe {} as a catalogue product.", ["a pair of wireless headphones", "a hardcover cookbook"]),
    ({"type": "object", "properties": {"items": {"type": "array", "minItems": 2, "maxItems": 5, "items": {
      "type": "object", "properties": {"name": NAME, "quantity": {"type": "integer", "minimum": 1, "maximum": 20}},
      "required": ["name", "quantity"], "additionalProperties": False}}},
      "required": ["items"], "additionalProperties": False},
     "Write a shopping list for {}.", ["a birthday party", "a week of camping"]),
    ({"type": "object", "properties": {"company": NAME, "address": {"type": "object", "properties": {
      "street": NAME, "city": NAME, "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": NAME},
      "required": ["street", "city", "postal_code", "country"], "additionalProperties": False}},
      "required": ["company", "address"], "additionalProperties": False},
     "Give the name and postal address of {}.", ["a small bakery in Paris", "a bicycle shop in Berlin"]),
    ({"type": "object", "properties": {"title": NAME, "date": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"},
      "location": NAME, "attendees": {"type": "array", "items": NAME, "maxItems": 4}},
      "required": ["title", "date", "location", "attendees"], "additionalProperties": False},
     "Plan {} as a calendar event.", ["a team lunch next Friday", "a book club meeting in May"]),
    ({"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
      "rating": {"type": "number", "minimum": 0, "maximum": 10}, "genres": {"type": "array", "minItems": 1,
      "maxItems": 3, "items": {"enum": ["action", "comedy", "drama", "horror", "sci-fi", "romance"]}},
      "summary": {"type": "string", "maxLength": 200}},
      "required": ["title", "year", "rating", "genres", "summary"], "additionalProperties": False},
     "Review {}.", ["a science fiction film about Mars", "a romantic comedy set in Rome"]),
    ({"type": "object", "properties": {"city": NAME, "temperature_c": {"type": "number", "minimum": -50,
      "maximum": 60}, "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]},
      "forecast": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
      "day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]}, "high": {"type": "number"},
      "low": {"type": "number"}}, "required": ["day", "high", "low"], "additionalProperties": False}}},
      "required": ["city", "temperature_c", "conditions", "forecast"], "additionalProperties": False},
     "Give a weather report for {}.", ["Oslo in winter", "Cairo in summer"]),
    ({"type": "object", "properties": {"name": NAME, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
      "vegetarian": {"type": "boolean"}, "ingredients": {"type": "array", "minItems": 2, "maxItems": 6, "items": {
      "type": "object", "properties": {"item": NAME, "amount": {"type": "string", "maxLength": 20}},
      "required": ["item", "amount"], "additionalProperties": False}}},
      "required": ["name", "servings", "vegetarian", "ingredients"], "additionalProperties": False},
     "Write a recipe for {}.", ["a tomato soup", "pancakes"]),
]  # fmt: skip


def workload(llm: LLM, num_requests: int, num_schemas: int) -> tuple[list[list[int]], list[dict]]:
    """Prompt ids and schemas: request i asks for schema i % num_schemas, with its first or second subject."""
    prompts, schemas = [], []
    for i in range(num_requests):
        schema, request, subjects = SCHEMAS[i % num_schemas]
        ask = request.format(subjects[i // num_schemas % 2])
        text = f"{ask} Reply with JSON matching this schema: {json.dumps(schema)}"
        messages = [{"role": "system", "content": "You answer in JSON."}, {"role": "user", "content": text}]
        prompts.append(llm.tokenizer.encode_chat(messages)[1])
        schemas.append(schema)
    return prompts, schemas


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], concurrency: int) -> tuple[list, float]:
    """The outputs and the wall seconds, `concurrency` requests per generate call."""
    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        outputs += llm.generate(prompts[i : i + concurrency], params[i : i + concurrency], use_tqdm=False)
    return outputs, time.perf_counter() - start


def compile_ms(llm: LLM, schemas: list[dict], repeats: int) -> tuple[float, float]:
    """Median ms to compile a schema never seen (a unique title) and the same params again (a cache hit)."""
    cold, cached, misses, hits = [], [], llm.engine.grammars.misses, llm.engine.grammars.hits
    for r in range(repeats):
        for i, schema in enumerate(schemas):
            params = StructuredOutputsParams(json={"title": f"bench-{time.time_ns()}-{r}-{i}", **schema})
            for times in (cold, cached):
                start = time.perf_counter()
                llm.engine.grammars.compile(params)
                times.append(1000 * (time.perf_counter() - start))
    assert llm.engine.grammars.misses - misses == len(cold) and llm.engine.grammars.hits - hits == len(cached)
    return statistics.median(cold), statistics.median(cached)


def check(outputs: list, schemas: list[dict]) -> str:
    """How the constrained outputs finished, and how many that finished "stop" parse and validate."""
    stop = [(o, s) for o, s in zip(outputs, schemas, strict=True) if o.outputs[0].finish_reason == "stop"]
    valid = 0
    for out, schema in stop:
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as error:
            print(f"  invalid: {type(error).__name__}: {str(error).splitlines()[0]} in {out.outputs[0].text!r}")
    reasons = [o.outputs[0].finish_reason for o in outputs]
    length = reasons.count("length")
    return f"{len(outputs)} outputs: {len(stop)} stop ({valid} valid JSON under their schema), {length} length"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--num-schemas", type=int, default=len(SCHEMAS), choices=range(1, len(SCHEMAS) + 1))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="requests per generate call")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration, alternated; medians")
    args = parser.parse_args()

    llm = LLM(args.model, max_num_seqs=max(args.concurrency), max_model_len=1024, enable_prefix_caching=False)
    prompts, schemas = workload(llm, args.num_requests, args.num_schemas)

    def json_params(max_tokens: int) -> list[SamplingParams]:
        return [
            SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=s))
            for s in schemas
        ]

    constrained = json_params(args.max_tokens)
    run(llm, prompts, json_params(4), len(prompts))  # compiles the grammars: the runs find them cached
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # first-execution costs
    runner = llm.engine.runner
    while not runner.deferred.ready:  # grammar rows sampled after launch: compiled in the background
        time.sleep(0.1)
    deferring = type(runner).defers_grammar

    kinds = ("constrained", "unconstrained", "waiting")
    rates = {(c, kind): [] for c in args.concurrency for kind in kinds}
    fill_s, finished = {c: [] for c in args.concurrency}, {c: [] for c in args.concurrency}
    for repeat in range(args.repeats):  # alternate so drifting machine load hits both alike
        for c in args.concurrency:
            llm.engine.runner.mask_fill_s.clear()
            outputs, seconds = run(llm, prompts, constrained, c)
            fill_s[c] += llm.engine.runner.mask_fill_s
            finished[c] += outputs
            lens = [len(o.outputs[0].token_ids) for o in outputs]
            free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
            free_outputs, free_seconds = run(llm, prompts, free, c)
            assert [len(o.outputs[0].token_ids) for o in free_outputs] == lens
            # the same constrained requests with each grammar row sampled inside its step, which then waits
            # for the step before it (no overlap for the whole batch)
            type(runner).defers_grammar = property(lambda self: False)
            waiting_outputs, waiting_seconds = run(llm, prompts, constrained, c)
            type(runner).defers_grammar = deferring
            assert [o.outputs[0].token_ids for o in waiting_outputs] == [o.outputs[0].token_ids for o in outputs]
            on, off, wait = sum(lens) / seconds, sum(lens) / free_seconds, sum(lens) / waiting_seconds
            for kind, rate in zip(kinds, (on, off, wait), strict=True):
                rates[c, kind].append(rate)
            print(f"repeat {repeat + 1}/{args.repeats} c={c}: {sum(lens)} tokens, constrained {on:.1f} tok/s, "
                  f"unconstrained {off:.1f} tok/s, constrained waiting {wait:.1f} tok/s")  # fmt: skip
    cold, cached = compile_ms(llm, [s for s, _, _ in SCHEMAS[: args.num_schemas]], args.repeats)

    print(
        f"{args.num_requests} requests over {args.num_schemas} JSON schemas, greedy, max_tokens {args.max_tokens}, "
        f"{args.repeats} repeats; unconstrained: the same prompts, ignore_eos, the constrained token counts"
    )
    print(f"{'concurrency':>11} {'constrained tok/s':>18} {'unconstrained tok/s':>20} {'ratio':>6} "
          f"{'waiting tok/s':>14} {'ratio':>6} {'mask fill p50 ms':>17} {'p99 ms':>7} {'steps':>6}")  # fmt: skip
    for c in args.concurrency:
        on, off, wait = (statistics.median(rates[c, kind]) for kind in kinds)
        fill = 1000 * np.array(fill_s[c])
        print(f"{c:>11} {on:18.1f} {off:20.1f} {on / off:5.2f}x {wait:14.1f} {wait / off:5.2f}x "
              f"{np.percentile(fill, 50):17.3f} {np.percentile(fill, 99):7.3f} {len(fill):6}")  # fmt: skip
    print(f"schema compile, median over {args.num_schemas} schemas x {args.repeats}: cold {cold:.2f} ms, "
          f"cached {cached:.4f} ms")  # fmt: skip
    for c in args.concurrency:
        print(f"c={c} check: {check(finished[c], schemas * args.repeats)}")


if __name__ == "__main__":
    main()
