"""A setting of `shadow router` is declared once (`shadow.base.knobs`): a field of `RouterConfig`
(`--policy`, `--max-body-bytes`, `--max-connections`, `--prefill-retries`) or of the command's
`Listen` (`--host`, `--port`) holds its flag, type, default, help, bound and choices, and the command
derives from it its flag (default, type, "(default X)" in the help) and its check, which names the
flag — shown for `max_connections` by introspection, and for every one of them (that none is written a
second time where the command builds its options: tests/cli/test_settings_once.py).

The command's own flags, not knobs: `--decode` and `--prefill` (repeatable [NAME=]URL lists, parsed
into the config's backends) and the logging flags (`add_log_arguments`, shared by the services)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, cast

import pytest

from shadow.active.standin import POLICIES, RouterConfig
from shadow.base.knobs import KNOB, Knob, knobs
from shadow.cli import build_parser, main
from shadow.commands.router import Listen, config_from_args
from tests.cli_parsers import action, subparser

KNOBS = [*knobs(RouterConfig), *knobs(Listen)]
BASE = ("--decode", "http://127.0.0.1:9")



def _action(dest: str) -> argparse.Action:
    return action("router", dest)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["router", *BASE, *argv])


def test_max_connections_is_one_field_and_everything_else_derives_from_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    field = next(f for f in dataclasses.fields(RouterConfig) if f.name == "max_connections")
    k = field.metadata[KNOB]
    assert isinstance(k, Knob) and k.flag == "--max-connections" and field.default == 1024
    flag = _action("max_connections")  # the flag: its default, type and help come from the field
    assert flag.option_strings == ["--max-connections"] and flag.default == 1024 and flag.type is int
    assert flag.help == "upstream connection pool size (default 1024)"
    assert config_from_args(_args()).max_connections == 1024
    assert config_from_args(_args("--max-connections", "8")).max_connections == 8
    # validated, naming the flag: by the config and by the command (exit 2, one line, nothing started)
    with pytest.raises(ValueError, match=r"^--max-connections must be >= 1, got 0$"):
        RouterConfig(decode={"d0": "http://x"}, max_connections=0)
    assert main(["router", *BASE, "--max-connections", "0"]) == 2
    assert capsys.readouterr().err == "shadow router: --max-connections must be >= 1, got 0\n"


@pytest.mark.parametrize(("field", "k"), KNOBS, ids=[k.flag for _, k in KNOBS])
def test_every_setting_is_a_flag_with_the_fields_default(field: dataclasses.Field[object], k: Knob) -> None:
    action = _action(k.dest)
    assert action.option_strings == [k.flag] and action.default == field.default
    assert action.help is not None and action.help.endswith(f"(default {field.default})")
    owner = RouterConfig if field in dataclasses.fields(RouterConfig) else Listen
    if owner is RouterConfig:  # not given: the field's default reaches the config
        assert getattr(config_from_args(_args()), field.name) == field.default
    if action.choices is not None:
        assert tuple(action.choices) == POLICIES and action.type is None
        return
    assert action.type is type(field.default)
    value = "7" if action.type is int else "0.0.0.0"
    assert getattr(_args(k.flag, value), k.dest) == cast(Any, action.type)(value)
    if owner is RouterConfig:
        assert getattr(config_from_args(_args(k.flag, value)), field.name) == int(value)


@pytest.mark.parametrize(("argv", "error"), [
    (("--prefill-retries=-1",), "--prefill-retries must be >= 0, got -1"),
    (("--max-body-bytes", "0"), "--max-body-bytes must be >= 1, got 0"),
    (("--port", "70000"), "--port must be a port in 0..65535 (0 = a free one), got 70000"),
])
def test_every_bound_names_its_flag(argv: tuple[str, ...], error: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", *BASE, *argv]) == 2
    assert capsys.readouterr().err == f"shadow router: {error}\n"


def test_the_cli_is_as_before() -> None:
    metavars = {a.dest: a.metavar for a in subparser("router")._actions}
    assert (metavars["decode"], metavars["prefill"]) == ("[NAME=]URL", "[NAME=]URL")
    assert all(metavars[k.dest] is None for _, k in KNOBS)  # argparse's: the dest, upper case
    args = _args()
    assert (args.policy, args.host, args.port, args.max_body_bytes, args.max_connections,
            args.prefill_retries) == ("jsq-bytes", "127.0.0.1", 8000, 8 << 20, 1024, 3)
    assert config_from_args(_args("--prefill-retries", "5")).retries == 5
    assert config_from_args(_args("--policy", "round-robin")).decode_policy() == "rr"
    with pytest.raises(SystemExit):
        _args("--policy", "nope")
    with pytest.raises(ValueError, match=r"^--policy must be one of .*jsq-bytes, got 'nope'$"):
        RouterConfig(decode={"d0": "http://x"}, policy="nope")
    usage = " ".join(subparser("router").format_usage().split())
    assert re.search(r"\[--policy \{rr,round-robin,jsq-bytes\}\] \[--host HOST\] \[--port PORT\] "
                     r"\[--max-body-bytes MAX_BODY_BYTES\] \[--max-connections MAX_CONNECTIONS\] "
                     r"\[--prefill-retries PREFILL_RETRIES\]", usage)
