"""Structured outputs through the engine: every output that ends with "stop" matches its constraint.

On a tiny random checkpoint only the token mask can make the output valid, so these tests show the mask
is applied (and nothing else). They also check that constrained requests are batch-, chunk-, cache- and
preemption-invariant like any other, compile nothing after warm-up, and that a bad spec is refused
before anything is queued.
"""

import json
import re
import time

import jsonschema
import pytest

from jserve import SamplingParams, StructuredOutputsParams
from jserve.engine.compile_guard import compile_count
from jserve.errors import RequestError

from structured_cases import SCHEMAS
from test_engine import prompts, tiny_llm, token_ids
from tiny_models import assert_engine_idle, tiny_kv_bytes

MAX_TOKENS = 160


@pytest.fixture(scope="module")
def llm(tiny_llama_checkpoint):
    engine = tiny_llm(tiny_llama_checkpoint[0], enable_prefix_caching=True)
    yield engine
    assert_engine_idle(engine)


def constrained(seed=None, temperature=0.0, max_tokens=MAX_TOKENS, **spec) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, seed=seed, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**spec)
    )


def start_deferred_sampling(runner) -> None:
    """Compile the runner's deferred grammar sampling (in the background, as the engine does) and wait for it."""
    runner.start_deferred_sampling()
    deadline = time.monotonic() + 300
    while not runner.deferred.ready:
        assert time.monotonic() < deadline, "the deferred sampling calls did not compile"
        time.sleep(0.05)


def validate(text: str, schema: dict) -> None:
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    validator.validate(json.loads(text))


def completions(outputs):
    return [c for out in outputs for c in out.outputs]


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_outputs_validate(llm, name):
    schema = SCHEMAS[name]
    params = constrained(seed=7, temperature=1.0, json=schema, disable_any_whitespace=True)
    outs = completions(llm.generate(prompts(4, seed=len(name)), params, use_tqdm=False))
    stopped = [c for c in outs if c.finish_reason == "stop"]
    assert stopped, [c.text for c in outs]  # a random model reaches the end of a bounded schema
    for c in stopped:
        validate(c.text, schema)


def test_flexible_whitespace_json_and_json_object(llm):
    schema = SCHEMAS["person"]
    for spec, check in ((dict(json=schema), lambda v: jsonschema.validate(v, schema)),
                        (dict(json_object=True), lambda v: isinstance(v, dict))):  # fmt: skip
        outs = completions(
            llm.generate(prompts(6, seed=1), constrained(seed=3, temperature=1.0, **spec), use_tqdm=False)
        )
        stopped = [c for c in outs if c.finish_reason == "stop"]
        for c in stopped:
            assert check(json.loads(c.text)) is not False
        assert stopped and all(c.finish_reason in ("stop", "length") for c in outs)


def test_regex_choice_and_grammar(llm):
    pattern = r"(yes|no)-[0-9]{2,4}"
    for c in completions(llm.generate(prompts(4), constrained(seed=1, temperature=1.0, regex=pattern), use_tqdm=False)):
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), c.text
    choices = ["alpha", "beta", "gamma delta"]
    for c in completions(
        llm.generate(prompts(6), constrained(seed=2, temperature=1.0, choice=choices), use_tqdm=False)
    ):
        assert c.finish_reason == "stop" and c.text in choices
    lark = 'start: "(" expr ")"\nexpr: NUMBER (OP NUMBER){0,3}\nOP: "+" | "-" | "*"\nNUMBER: /[1-9][0-9]?/'
    for c in completions(llm.generate(prompts(4), constrained(seed=3, temperature=1.0, grammar=lark), use_tqdm=False)):
        assert c.finish_reason == "stop" and re.fullmatch(r"\([1-9][0-9]?([-+*][1-9][0-9]?){0,3}\)", c.text), c.text
    gbnf = 'root ::= "x" [0-9] [0-9]'
    for c in completions(llm.generate(prompts(2), constrained(grammar=gbnf), use_tqdm=False)):
        assert c.finish_reason == "stop" and re.fullmatch(r"x[0-9]{2}", c.text), c.text


def test_max_tokens_first_is_length(llm):
    out = llm.generate(prompts(1), constrained(max_tokens=3, regex="[a-z]{10}"), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and re.fullmatch("[a-z]*", out.text)


def test_a_mixed_batch_gives_each_request_its_solo_tokens(llm):
    """Constrained and free rows, greedy and seeded, side by side: each as it would be alone."""
    batch = prompts(6, seed=11)
    params = [
        constrained(json=SCHEMAS["product"], disable_any_whitespace=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        constrained(seed=5, temperature=0.8, regex="[a-z ]{5,30}[.]"),
        SamplingParams(temperature=1.0, seed=9, max_tokens=40, ignore_eos=True),
        constrained(seed=6, temperature=1.0, choice=["one", "two", "three"]),
        constrained(seed=8, temperature=1.0, json=SCHEMAS["nested objects"], disable_any_whitespace=True),
    ]
    together = token_ids(llm.generate(batch, params, use_tqdm=False))
    alone = [token_ids(llm.generate([p], [q], use_tqdm=False))[0] for p, q in zip(batch, params, strict=True)]
    assert together == alone


def test_grammar_rows_drawn_after_launch_give_the_tokens_of_waiting(llm, monkeypatch):
    """With async scheduling a grammar row whose previous token is still in flight is sampled after launch,
    once the host has its mask (the other rows keep their overlap): the tokens are those of a step that waits
    for its predecessor and samples the row itself."""
    runner = llm.engine.runner
    start_deferred_sampling(runner)
    batch = prompts(5, seed=31)
    params = [
        constrained(json=SCHEMAS["product"], disable_any_whitespace=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        constrained(seed=5, temperature=0.8, regex="[a-z ]{5,30}[.]"),
        constrained(seed=6, temperature=1.0, choice=["one", "two", "three"]),
        constrained(seed=8, temperature=1.0, json=SCHEMAS["nested objects"], disable_any_whitespace=True),
    ]
    drawn, sample_deferred = [], runner.sample_deferred
    monkeypatch.setattr(runner, "sample_deferred", lambda *args: drawn.append(len(args[1])) or sample_deferred(*args))
    after_launch = token_ids(llm.generate(batch, params, use_tqdm=False))
    assert drawn  # grammar rows were drawn after launch
    monkeypatch.setattr(type(runner), "defers_grammar", property(lambda self: False))
    drawn.clear()
    waiting = token_ids(llm.generate(batch, params, use_tqdm=False))
    assert not drawn and after_launch == waiting


def test_chunked_prefill_prefix_hits_and_preemption_keep_the_tokens(tiny_llama_checkpoint, llm):
    batch = prompts(6, seed=12, low=60, high=120)
    params = constrained(seed=4, temperature=1.0, json=SCHEMAS["array of objects"], disable_any_whitespace=True)
    params = [params, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)] * 3
    expected = token_ids(llm.generate(batch, params, use_tqdm=False))
    assert token_ids(llm.generate(batch, params, use_tqdm=False)) == expected  # now from the prefix cache
    cramped = tiny_llm(tiny_llama_checkpoint[0], kv_cache_memory=tiny_kv_bytes(24), max_num_batched_tokens=32)
    outputs = cramped.generate(batch, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert token_ids(outputs) == expected
    assert_engine_idle(cramped)


def test_n_seeds_stop_strings_and_logprobs(llm):
    params = SamplingParams(
        n=3, temperature=1.0, seed=21, max_tokens=MAX_TOKENS, logprobs=2, stop=["c"],
        structured_outputs=StructuredOutputsParams(regex="[ab]{3,8}c?"),
    )  # fmt: skip
    first = llm.generate(prompts(1, seed=13), params, use_tqdm=False)[0]
    again = llm.generate(prompts(1, seed=13), params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    for c in first.outputs:
        assert c.finish_reason == "stop" and re.fullmatch("[ab]{3,8}", c.text), c.text
        assert len(c.logprobs) == len(c.token_ids)


def test_no_compilation_for_structured_requests(llm):
    before = compile_count()
    llm.generate(prompts(3), constrained(json=SCHEMAS["enum"], disable_any_whitespace=True), use_tqdm=False)
    assert compile_count() == before


def test_grammars_compile_once_per_spec(llm):
    grammars = llm.engine.grammars
    params = constrained(regex="[0-9]{4}")
    hits = grammars.hits
    llm.generate(prompts(2), [params, constrained(regex="[0-9]{4}")], use_tqdm=False)
    assert grammars.hits >= hits + 1
    assert grammars.compile(params.structured_outputs) is grammars.compile(params.structured_outputs)


@pytest.mark.parametrize(
    "spec, message",
    [
        (dict(regex="a(b"), "invalid regex"),
        (dict(json={"type": "no-such-type"}), "invalid json"),
        (dict(json={"not": {"type": "string"}}), "Unimplemented"),  # refused, never silently ignored
        (dict(grammar="start: undefined_rule"), "invalid grammar"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(choice=[]), "choice must be"),
        (dict(regex="a", choice=["a"]), "exactly one"),
        (dict(), "exactly one"),
    ],
)
def test_bad_specs_are_refused_before_anything_is_queued(llm, spec, message):
    with pytest.raises(RequestError, match=message) as error:
        llm.generate(prompts(2), constrained(**spec), use_tqdm=False)
    assert error.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()
