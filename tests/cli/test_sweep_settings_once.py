"""The steady-state protocol's settings of `shadow sweep` and `shadow replay --steady` are declared
once (`shadow.base.knobs`): a field of `Protocol` (`--warmup`, `--window`, `--max-requests`) holds its
flag, type, default, help and bound, and both commands derive from it their flag (default, type,
"(default X)" in the help) and its check, which names the flag — shown for `window_lifetimes` by
introspection, and for every one of them (that none is written a second time where the commands
build their options: tests/cli/test_settings_once.py).

Hand-written still: `--timeout` and `--queue` (0 = none on the command line, None in `Protocol`: the
flag's default is not the field's), `--seeds` (a comma list, a tuple in `Protocol`), `--jobs` (the
local runner's, not the protocol's); the fleet, BalanceRoute and step-model flags of
`_replay_args` (`--slots -G/-B` have short aliases, and the BR and step flags fill `BRParams` and
`StepTimeModel` of the pure core, with the `Given` action that lets a recording's settings apply to
every flag not given)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, cast

import pytest

from shadow.base.knobs import KNOB, Knob, knobs
from shadow.cli import build_parser, main
from shadow.commands.sweep_protocol import protocol_from
from shadow.replay.protocol import Protocol
from tests.cli_parsers import action, subparser

KNOBS = list(knobs(Protocol))
COMMANDS = {"sweep": ("paper-azure",), "replay": ("paper-azure", "--steady")}



def _args(command: str, *argv: str) -> argparse.Namespace:
    return build_parser().parse_args([command, *COMMANDS[command], *argv])


@pytest.mark.parametrize("command", list(COMMANDS))
def test_window_is_one_field_and_everything_else_derives_from_it(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    field = next(f for f in dataclasses.fields(Protocol) if f.name == "window_lifetimes")
    k = field.metadata[KNOB]
    assert isinstance(k, Knob) and k.flag == "--window" and field.default == 5.0
    flag = action(command, "window")  # the flag: its default, type and help come from the field
    assert flag.option_strings == ["--window"] and flag.default == 5.0 and flag.type is float
    assert flag.help == "measured window, in lifetimes (default 5)"
    assert protocol_from(_args(command)).window_lifetimes == 5.0
    assert protocol_from(_args(command, "--window", "2")).window_lifetimes == 2.0
    # validated, naming the flag: by the protocol and by the command (exit 2, one line, nothing run)
    with pytest.raises(ValueError, match=r"^--window must be > 0, got 0$"):
        Protocol(window_lifetimes=0)
    assert main([command, *COMMANDS[command], "--window", "0"]) == 2
    assert capsys.readouterr().err == f"shadow {command}: --window must be > 0, got 0.0\n"


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize(("field", "k"), KNOBS, ids=[k.flag for _, k in KNOBS])
def test_every_setting_is_a_flag_with_the_fields_default(
        command: str, field: dataclasses.Field[object], k: Knob) -> None:
    flag = action(command, k.dest)
    assert flag.option_strings == [k.flag] and flag.default == field.default and flag.metavar is None
    assert flag.type is type(field.default)
    shown = format(cast(Any, field.default), "g")
    assert flag.help is not None and flag.help.endswith(f"(default {shown})")
    assert getattr(protocol_from(_args(command)), field.name) == field.default
    assert getattr(protocol_from(_args(command, k.flag, "12")), field.name) == 12


@pytest.mark.parametrize(("argv", "error"), [
    (("--warmup=-1",), "--warmup must be >= 0, got -1.0"),
    (("--max-requests", "9"), "--max-requests must be >= 10, got 9"),
])
def test_every_bound_names_its_flag(argv: tuple[str, ...], error: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", *COMMANDS["sweep"], *argv]) == 2
    assert capsys.readouterr().err == f"shadow sweep: {error}\n"


def test_the_hand_written_protocol_flags_are_as_before() -> None:
    proto = protocol_from(_args("sweep"))
    assert (proto.timeout_s, proto.queue_per_worker, proto.seeds) == (None, 6, (0, 1, 2))
    proto = protocol_from(_args("sweep", "--timeout", "2", "--queue", "0", "--seeds", "4,5"))
    assert (proto.timeout_s, proto.queue_per_worker, proto.seeds) == (2.0, None, (4, 5))
    usage = " ".join(subparser("sweep").format_usage().split())
    assert re.search(r"\[--warmup WARMUP\] \[--window WINDOW\] \[--timeout TIMEOUT\] \[--queue N\] "
                     r"\[--max-requests MAX_REQUESTS\] \[--jobs JOBS\]", usage)
