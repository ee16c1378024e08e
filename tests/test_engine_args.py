"""EngineArgs declares each setting once: the commands' flags are made from its fields, `LLM` takes its
fields as keywords (naming any other), and docs/configuration.md's table lists every one."""

import re
from dataclasses import fields
from pathlib import Path

import pytest

from jserve import LLM
from jserve.cli import build_parser
from jserve.config_file import _subcommands
from jserve.engine.args import EngineArgs


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_every_field_is_a_flag_with_its_default_and_help(command):
    parser = _subcommands(build_parser())[command]
    actions = {action.dest: action for action in parser._actions}
    for f in fields(EngineArgs):
        action = actions[f.name]
        positional = command == "serve" and f.name == "model"
        assert action.option_strings[:1] == ([] if positional else ["--" + f.name.replace("_", "-")])
        assert (action.default, action.help) == (f.default, f.metadata["flag"].help)
        assert action.choices == f.metadata["flag"].choices


def test_flags_parse_to_engine_args():
    parse = build_parser().parse_args
    assert EngineArgs.from_cli_args(parse(["generate", "hi"])) == EngineArgs()
    args = EngineArgs.from_cli_args(parse(["serve", "some/model", "--scheduling-policy", "lpm", "--max-num-seqs",
                                           "3", "--no-enable-prefix-caching"]))  # fmt: skip
    assert args == EngineArgs(model="some/model", schedule_policy="lpm", max_num_seqs=3, enable_prefix_caching=False)


def test_an_unknown_keyword_is_named_before_any_model_loads():
    with pytest.raises(TypeError, match="no setting 'max_num_seq'; did you mean 'max_num_seqs'"):
        LLM("no/such-model", max_num_seq=4)
    with pytest.raises(TypeError, match=r"no setting 'colour'$"):
        LLM(colour="blue")


def test_the_configuration_docs_list_every_setting():
    docs = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    listed = set(re.findall(r"^\| `(\w+)`", docs, flags=re.M))
    assert {f.name for f in fields(EngineArgs)} <= listed
