"""pythonic: the output is a Python list of calls, `[get_weather(city="Paris"), f(x=[1, 2], y=None)]` (Llama 4,
Llama 3.2). Each argument is a keyword with a Python literal for value, which becomes JSON (None: null).
Anything else, a non-literal value included, is content: the text is parsed by `ast`, never evaluated.
"""

from __future__ import annotations

import ast
import math

from jserve.tools.calls import ToolCall, new_call
from jserve.tools.scan import Scanner, ScanningParser
from jserve.tools.whole_output import WholeOutputScanner


def may_be_calls(text: str) -> bool:
    return text.lstrip()[:1] in ("", "[")


def parse_calls(text: str) -> list[ToolCall] | None:
    source = text.strip()
    if not source.startswith("["):  # "([f()])" is a list to Python, but may_be_calls said no
        return None
    try:
        tree = ast.parse(source, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = [_call(node) for node in tree.elts]
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # what ast refuses a text with
        return None
    return None if None in calls else calls


def _call(node: ast.expr) -> ToolCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    names = [keyword.arg for keyword in node.keywords]
    if None in names or len(set(names)) < len(names):  # **kwargs, or a keyword given twice
        return None
    arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
    return new_call(node.func.id, arguments) if _is_json(arguments) else None


def _is_json(value: object) -> bool:
    """Whether value has a JSON text: a tuple becomes an array; sets, bytes, complex, NaN and inf have none."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_is_json(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _is_json(item) for key, item in value.items())
    return False


class PythonicParser(ScanningParser):
    name = "pythonic"

    def scanner(self) -> Scanner:
        return WholeOutputScanner(may_be_calls, parse_calls).step
