"""A setting of `shadow load` is declared once (`shadow.base.knobs`): a field of `LoadOptions` holds
its flag, type, default, help and bound, and the command derives from it its flag (default, type,
"(default X)" in the help) and its check, which names the flag — shown for `concurrency` by
introspection, and for every one of them (that none is written a second time where the command
builds its options: tests/cli/test_settings_once.py).

The command's own flags, not knobs: `--target` (required: the run's endpoint), `--seed` and
`--chat-overhead` (the prompt builder's; --seed seeds the synthetic workload too), `--stream/
--no-stream` and `--no-ignore-eos` (on by default; a knob's switch is off by default),
`--rate-scale` and `--rate` (other ways to give the time scale), `--header` (repeatable), `--json`,
`--quiet` (the command's output)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, cast

import pytest

from shadow.base.knobs import KNOB, Knob, knobs
from shadow.cli import build_parser, main
from shadow.commands.load import options_from_args
from shadow.loadgen.options import LoadOptions
from tests.cli_parsers import action, shown, subparser

KNOBS = list(knobs(LoadOptions))
BASE = ("paper-azure", "--target", "http://127.0.0.1:9")



def _action(dest: str) -> argparse.Action:
    return action("load", dest)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["load", *BASE, *argv])



def test_concurrency_is_one_field_and_everything_else_derives_from_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    field = next(f for f in dataclasses.fields(LoadOptions) if f.name == "concurrency")
    k = field.metadata[KNOB]
    assert isinstance(k, Knob) and k.flag == "--concurrency" and field.default is None
    flag = _action("concurrency")  # the flag: its default, type and help come from the field
    assert flag.option_strings == ["--concurrency"] and flag.default is None and flag.type is int
    assert flag.metavar == "C" and flag.help is not None and flag.help.endswith("(default none)")
    assert "later arrivals wait in order (none: no cap) (default none)" in " ".join(
        subparser("load").format_help().split())
    assert options_from_args(_args()).concurrency is None
    assert options_from_args(_args("--concurrency", "8")).concurrency == 8
    # validated, naming the flag: by the options and by the command (exit 1, one line, before the trace)
    with pytest.raises(ValueError, match=r"^--concurrency must be >= 1, got 0$"):
        LoadOptions(concurrency=0)
    with pytest.raises(ValueError, match=r"^--concurrency must be >= 1, got 0$"):
        options_from_args(_args("--concurrency", "0"))
    assert main(["load", *BASE, "--concurrency", "0"]) == 1
    assert capsys.readouterr().err == "shadow load: error: --concurrency must be >= 1, got 0\n"


@pytest.mark.parametrize(("field", "k"), KNOBS, ids=[k.flag for _, k in KNOBS])
def test_every_setting_is_a_flag_with_the_fields_default(field: dataclasses.Field[object], k: Knob) -> None:
    action = _action(k.dest)
    assert action.option_strings == [k.flag]
    # not given: the field's default reaches the options
    assert getattr(options_from_args(_args()), field.name) == field.default
    if isinstance(field.default, bool):
        assert action.default is False and isinstance(action, argparse._StoreTrueAction)
        assert getattr(options_from_args(_args(k.flag)), field.name) is True
        return
    # --time-scale is None when not given (--rate-scale and --rate are the other ways to say it)
    assert action.default == (None if k.flag == "--time-scale" else field.default)
    assert action.help is not None and action.help.endswith(f"(default {shown(field.default)})")
    assert action.type is k.kw.get("type", type(field.default) if field.default is not None else None)
    value = {int: "3", float: "0.5"}.get(cast(type, action.type), "x")
    typed = cast(Any, action.type)(value) if action.type else value
    assert getattr(options_from_args(_args(k.flag, value)), field.name) == typed


@pytest.mark.parametrize(("field", "k"), [(f, k) for f, k in KNOBS if k.bound is not None],
                         ids=[k.flag for _, k in KNOBS if k.bound is not None])
def test_every_bound_names_its_flag(field: dataclasses.Field[object], k: Knob) -> None:
    with pytest.raises(ValueError, match=rf"^{re.escape(k.flag)} must be .*, got 0(\.0)?$"):
        options_from_args(_args(f"{k.flag}=0"))
    with pytest.raises(ValueError, match=rf"^{re.escape(k.flag)} must be .*, got 0$"):
        LoadOptions(**{field.name: cast(Any, 0)})


def test_the_cli_is_as_before() -> None:
    metavars = {a.dest: a.metavar for a in subparser("load")._actions}
    assert {d: metavars[d] for d in ("limit", "time_scale", "rate_scale", "rate", "concurrency", "timeout",
                                     "request_id_prefix", "header", "chat_overhead", "json")} == {
        "limit": "N", "time_scale": "X", "rate_scale": "X", "rate": "RPS", "concurrency": "C", "timeout": "S",
        "request_id_prefix": "P", "header": "K=V", "chat_overhead": "K", "json": "OUT"}
    assert metavars["model"] is None and metavars["api_key"] is None
    args = _args()
    assert (args.model, args.api_key, args.limit, args.seed, args.concurrency, args.stream, args.chat) == (
        None, "EMPTY", None, 0, None, True, False)
    assert (args.time_scale, args.rate_scale, args.rate, args.timeout, args.ignore_eos) == (
        None, None, None, 600.0, True)
    got = options_from_args(_args("--no-stream", "--no-ignore-eos", "--header", "a=b", "--seed", "3",
                                  "--chat-overhead", "4", "--rate-scale", "2"))
    assert (got.stream, got.ignore_eos, dict(got.headers), got.time_scale) == (False, False, {"a": "b"}, 2.0)
    assert got.prompt_builder is not None and (got.prompt_builder.seed, got.prompt_builder.chat_overhead) == (
        3, 4)
    assert options_from_args(_args("--timeout", "inf")).request_timeout_s == float("inf")  # no timeout
    with pytest.raises(SystemExit):  # the pace flags exclude each other
        _args("--time-scale", "2", "--rate", "1")
    usage = " ".join(subparser("load").format_usage().split())
    assert "[--time-scale X | --rate-scale X | --rate RPS]" in usage


def test_the_other_ways_to_give_the_time_scale_name_their_flags() -> None:
    with pytest.raises(ValueError, match=r"^--rate-scale must be > 0, got 0\.0$"):
        options_from_args(_args("--rate-scale", "0"))
    with pytest.raises(ValueError, match=r"^--rate must be > 0, got -1\.0$"):
        options_from_args(_args("--rate=-1"))
    with pytest.raises(ValueError, match=r"^--header must be K=V"):
        options_from_args(_args("--header", "nokey"))
