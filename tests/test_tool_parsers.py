"""Tool-call parsers: each format's calls and content, and streaming that adds up to parse() at every split.

The streaming checks feed each text in two pieces at every index, one character at a time, and in random
pieces; random texts built from each format's markup check that nothing is ever lost and that streaming
agrees with parse() beyond the hand-written cases.
"""

import json
import random
import re

import pytest

from jserve.tools import TOOL_PARSERS, ParsedOutput, StreamDelta, ToolParser, get_tool_parser
from jserve.tools.calls import new_call

CALL_ID = re.compile(r"call_[0-9a-f]{24}")

WEATHER = {"city": "Paris", "days": 3}
UNICODE = {"city": "Zürich", "note": "東京 🙂 naïve", "quote": 'say "hi"\n'}


def block(name, arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def plain(text):
    """A case with no calls: the text is all content."""
    return text, text, []


# (text, content, [(name, arguments)]) for each format.
# fmt: off
CASES = {
    "hermes": [
        (block("get_weather", WEATHER), None, [("get_weather", WEATHER)]),
        (block("f", {"a": 1}) + "\n" + block("g", {}), None, [("f", {"a": 1}), ("g", {})]),
        ("Let me check.\n" + block("f", {"a": [1, 2]}), "Let me check.\n", [("f", {"a": [1, 2]})]),
        ("A " + block("f", {}) + " B " + block("g", {}) + " C", "A  B  C", [("f", {}), ("g", {})]),
        ('<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>', None, [("f", {"a": 1})]),
        ("<tool_call>" + json.dumps({"name": "f", "arguments": UNICODE}, ensure_ascii=False) + "</tool_call>",
         None, [("f", UNICODE)]),
        ('<tool_call>{"name": "f", "arguments": {"x": "<tool_call>"}}</tool_call>', None,
         [("f", {"x": "<tool_call>"})]),
        plain("Just text, no calls: <tool> <tool_ca"),
        ("", None, []),
        ("  \n ", None, []),
        # Malformed blocks stay content, tags and all; well-formed ones around them are still calls.
        plain('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>'),
        plain('<tool_call>{"arguments": {}}</tool_call>'),
        plain('<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
        plain('<tool_call>{"name": "f"}</tool_call>'),
        plain('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
        plain("Hi " + block("f", {"a": 1})[:-3]),  # never closed
        ("<tool_call>oops " + block("f", {}), "<tool_call>oops ", [("f", {})]),
        ("x " + block("f", {}) + " <tool_call>{bad}</tool_call> " + block("g", {"b": None}),
         "x  <tool_call>{bad}</tool_call> ", [("f", {}), ("g", {"b": None})]),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None, [("get_weather", WEATHER)]),
        ('<|python_tag|>{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
        ('\n <|python_tag|> {"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": [true]}};\n',
         None, [("f", {}), ("g", {"b": [True]})]),
        ('{"name": "f", "parameters": {"x": "a;b"}};{"name": "g", "parameters": {}}', None,
         [("f", {"x": "a;b"}), ("g", {})]),
        (json.dumps({"name": "f", "parameters": UNICODE}, ensure_ascii=False), None, [("f", UNICODE)]),
        plain("The weather is sunny."),
        plain("  <|python"),
        plain('Sure: {"name": "f", "parameters": {}}'),
        plain('{"answer": 42}'),
        plain('{"name": "f", "parameters": {'),
        plain('{"name": "f", "parameters": 3}'),
        plain('{"name": "f", "parameters": {}} and more'),
        plain('{"name": "f", "parameters": {}} {"name": "g", "parameters": {}}'),
        plain("<|python_tag|>print(1)"),
        ("", None, []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]', None,
         [("get_weather", WEATHER)]),
        ('[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"a": [1]}}]', None,
         [("f", {}), ("g", {"a": [1]})]),
        ('Checking. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}] Done.', "Checking.  Done.", [("f", {"a": 1})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', None, [("get_weather", WEATHER)]),
        ('[TOOL_CALLS]f[ARGS]{"a": "]"}[TOOL_CALLS]g[ARGS] {}', None, [("f", {"a": "]"}), ("g", {})]),
        ("[TOOL_CALLS]f[ARGS]" + json.dumps(UNICODE, ensure_ascii=False), None, [("f", UNICODE)]),
        plain("See [the docs](x) or [TOOL] [TOOL_CA"),
        plain('[TOOL_CALLS][{"name": "f", "arguments": {}]'),
        plain('[TOOL_CALLS][{"name": "f", "arguments": "x"}]'),
        plain("[TOOL_CALLS][]"),
        plain("[TOOL_CALLS]"),
        plain("[TOOL_CALLS]f[ARGS][1]"),
        plain("[TOOL_CALLS]f(x)"),
        plain('[TOOL_CALLS]f[ARGS]{"a": 1'),
        ("[TOOL_CALLS]oops [TOOL_CALLS]f[ARGS]{}", "[TOOL_CALLS]oops ", [("f", {})]),
        ("", None, []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3)]', None, [("get_weather", WEATHER)]),
        ('[f(x=[1, 2], y={"a": None}), g(), h(t=(True, False), n=-1.5)]', None,
         [("f", {"x": [1, 2], "y": {"a": None}}), ("g", {}), ("h", {"t": [True, False], "n": -1.5})]),
        ("\n[f(city='Zürich', note='東京 🙂 naïve', quote='say \"hi\"\\n')]\n", None, [("f", UNICODE)]),
        plain("The answer is 4."),
        plain("Sure: [f(x=1)]"),
        plain("[f(x=1]"),
        plain("[f(x=open('a'))]"),
        plain("[f(x=__import__('os').system('ls'))]"),
        plain("[f(1)]"),
        plain("[f(x=1, x=2)]"),
        plain("[f(**kw)]"),
        plain("[os.system(x=1)]"),
        plain("[f(x={1, 2})]"),
        plain("[f(x=1e999)]"),
        plain("[f(x={1: 2})]"),
        plain("[1, 2, 3]"),
        plain("[]"),
        plain("([f(x=1)])"),
        ("", None, []),
    ],
}
# fmt: on
ALL_CASES = [(name, *case) for name, cases in CASES.items() for case in cases]


def calls_of(output: ParsedOutput):
    return [(call.name, call.arguments) for call in output.tool_calls]


def streamed(tool_parser: ToolParser, pieces) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) of the calls rebuilt from streaming pieces, checking the deltas' shape."""
    streamer = tool_parser.streamer()
    deltas = [streamer.feed(piece) for piece in pieces] + [streamer.finish()]
    content, calls = "", {}
    for delta in deltas:
        content += delta.content
        for call in delta.tool_calls:
            if call.index in calls:
                assert call.id is None and call.name is None, "a call's id and name come once"
                calls[call.index][2] += call.arguments
            else:
                assert call.index == len(calls), "calls are numbered in order"
                assert CALL_ID.fullmatch(call.id) and call.name
                calls[call.index] = [call.id, call.name, call.arguments]
    return content, [(name, arguments) for _, name, arguments in calls.values()]


def assert_streams_like_parse(name: str, text: str, splits: list[list[int]]) -> None:
    tool_parser = get_tool_parser(name)
    expected = tool_parser.parse(text)
    for cuts in splits:
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed(tool_parser, pieces) == (expected.content or "", calls_of(expected)), pieces


def all_splits(text: str, rng: random.Random) -> list[list[int]]:
    """Two pieces at every index, one character at a time, and five random splits."""
    n = len(text)
    randoms = [sorted(rng.sample(range(n + 1), rng.randint(0, n + 1))) for _ in range(5)]
    return [[i] for i in range(n + 1)] + [list(range(1, n))] + randoms


@pytest.mark.parametrize("name, text, content, calls", ALL_CASES)
def test_parse(name, text, content, calls):
    out = get_tool_parser(name).parse(text)
    assert out.content == content
    assert calls_of(out) == [(f, json.dumps(args, ensure_ascii=False)) for f, args in calls]
    for call in out.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
    if not calls:
        assert out.content == (text if text.strip() else None)  # nothing that is not a call is lost


@pytest.mark.parametrize("name, text, content, calls", ALL_CASES)
def test_streaming_at_every_split(name, text, content, calls):
    assert_streams_like_parse(name, text, all_splits(text, random.Random(len(text))))


def test_unicode_arguments_are_not_escaped():
    text = "<tool_call>" + json.dumps({"name": "f", "arguments": UNICODE}) + "</tool_call>"  # escaped in the input
    (call,) = get_tool_parser("hermes").parse(text).tool_calls
    assert "Zürich" in call.arguments and "🙂" in call.arguments and "\\u" not in call.arguments


@pytest.mark.parametrize("depth", [990, 5000])
def test_deep_nesting_stays_content_or_parses(depth):
    nested = "[" * depth + "]" * depth
    texts = {
        "hermes": f'<tool_call>{{"name": "f", "arguments": {{"a": {nested}}}}}</tool_call>',
        "llama3_json": f'{{"name": "f", "parameters": {{"a": {nested}}}}}',
        "mistral": f'[TOOL_CALLS]f[ARGS]{{"a": {nested}}}',
        "pythonic": f"[f(a={nested})]",
    }
    for name, text in texts.items():
        out = get_tool_parser(name).parse(text)  # too deep for json or ast: no RecursionError comes out
        parsed = out.content is None and [(c.name, c.arguments.count("[")) for c in out.tool_calls] == [("f", depth)]
        assert parsed or (out.content == text and out.tool_calls == []), name


def test_arguments_too_deep_to_encode_are_no_call():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert new_call("f", {"a": deep}) is None  # json.dumps gives up; where json.loads did not, the text stays


def test_ids():
    for name, text in (("hermes", block("f", {}) + block("f", {})), ("pythonic", "[f(), f()]")):
        tool_parser = get_tool_parser(name)
        ids = [call.id for call in tool_parser.parse(text).tool_calls]
        ids += [call.id for call in tool_parser.parse(text).tool_calls]
        assert len(ids) == 4 and len(set(ids)) == 4
        assert all(CALL_ID.fullmatch(call_id) for call_id in ids), ids


def test_hermes_streams_content_and_calls_as_soon_as_settled():
    streamer = get_tool_parser("hermes").streamer()
    assert streamer.feed("Let me check. <tool").content == "Let me check. "  # "<tool" may begin a block
    held = streamer.feed('_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_')
    assert held.content == "" and held.tool_calls == []
    delta = streamer.feed("call>\nThe <too")
    assert delta.content == "\nThe " and [(c.index, c.name, c.arguments) for c in delta.tool_calls] == [
        (0, "f", '{"a": 1}')
    ]
    assert streamer.feed("ls are here").content == "<tools are here"
    assert streamer.finish() == StreamDelta("", [])


def test_mistral_holds_only_what_may_be_markup():
    streamer = get_tool_parser("mistral").streamer()
    assert streamer.feed("See [docs] [TOOL_").content == "See [docs] "
    assert streamer.feed('CALLS][{"name": "f", "arguments": {}}').content == ""
    delta = streamer.feed("] ok")
    assert delta.content == " ok" and [c.name for c in delta.tool_calls] == ["f"]


@pytest.mark.parametrize("name, call", [("llama3_json", '{"name": "f", "parameters": {}}'), ("pythonic", "[f()]")])
def test_whole_output_formats_stream_plain_text_at_once(name, call):
    streamer = get_tool_parser(name).streamer()
    assert streamer.feed("  ").content == ""
    assert streamer.feed("Hello").content == "  Hello"
    assert streamer.feed(" " + call).content == " " + call
    assert streamer.finish().tool_calls == []
    streamer = get_tool_parser(name).streamer()
    assert streamer.feed(call).content == "" and streamer.feed("").tool_calls == []
    assert [c.name for c in streamer.finish().tool_calls] == ["f"]


def test_whitespace_only_content_is_none_when_streamed():
    streamer = get_tool_parser("hermes").streamer()
    deltas = [streamer.feed(" \n"), streamer.feed(block("f", {})), streamer.feed("\n"), streamer.finish()]
    assert "".join(d.content for d in deltas) == ""
    assert get_tool_parser("hermes").parse(" \n" + block("f", {}) + "\n").content is None


# Random texts from each format's markup, well- and ill-formed: parse() never loses text, and streaming agrees.
# Per format: (prefix, separator, suffix, well-formed calls, noise); each kept or not at random.
# fmt: off
RANDOM_FORMS = {
    "hermes": ("", "", "", [block("f", {"a": 1}), '<tool_call>{"name": "g", "arguments": {"s": "é🙂"}}</tool_call>'],
               ["<tool_call>", "</tool_call>", "<tool", "_call>", '{"name": "g"', "}", "\n", " ", "text", "<", ">"]),
    "llama3_json": ("<|python_tag|>", ";", "",
                    ['{"name": "f", "parameters": {"a": 1}}', ' {"name": "g", "arguments": {"s": "é🙂"}}\n'],
                    ["<|py", '{"name": "g"', "}", "{", ";", " ", "\n", "x", "[]"]),
    "mistral": ("", "", "", ['[TOOL_CALLS][{"name": "f", "arguments": {}}]', '[TOOL_CALLS]g[ARGS]{"s": "é🙂"}'],
                ["[TOOL_CALLS]", "[TOOL_", "[ARGS]", "f", '{"a": "]"}', "]", "[", "{", " ", "text"]),
    "pythonic": ("[", ", ", "]", ["f(x=1)", "g(s='é🙂', y=[None, True])"],
                 ["[", "]", "f(", "g(x=1", ")", "None", " ", "\n", "text", "x="]),
}
# fmt: on


def random_text(rng: random.Random, name: str) -> str:
    prefix, separator, suffix, calls, noise = RANDOM_FORMS[name]
    items = [rng.choice(calls) if rng.random() < 0.6 else rng.choice(noise) for _ in range(rng.randint(1, 4))]
    return (prefix if rng.random() < 0.8 else "") + separator.join(items) + (suffix if rng.random() < 0.8 else "")


@pytest.mark.parametrize("name", RANDOM_FORMS)
def test_random_texts(name):
    rng = random.Random(name)
    tool_parser, outputs_with_calls = get_tool_parser(name), 0
    for _ in range(300):
        text = random_text(rng, name)
        out = tool_parser.parse(text)
        outputs_with_calls += bool(out.tool_calls)
        if not out.tool_calls:
            assert out.content == (text if text.strip() else None), text
        n = len(text)
        randoms = [sorted(rng.sample(range(n + 1), min(n + 1, rng.randint(1, 4)))) for _ in range(3)]
        assert_streams_like_parse(name, text, [list(range(1, n)), *randoms])
    assert 30 < outputs_with_calls < 270, outputs_with_calls  # both kinds are tested


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    for name in TOOL_PARSERS:
        assert get_tool_parser(name).name == name
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        get_tool_parser("nope")
