"""A setting of `shadow fleet` is declared once (`shadow.base.knobs`): a field of `FleetConfig` holds
its flag, type, default, help and bound, and the command derives from it its flag (default, type,
"(default X)" in the help) and its check, which names the flag — shown for `slots` by
introspection, and for every one of them (that none is written a second time where `shadow fleet`
builds its options: tests/cli/test_settings_once.py). `--fault`, `--otlp-traces-endpoint` and the
`--engine vllm` group are the command's own flags, not FleetConfig's settings."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from shadow.base.knobs import KNOB, Knob, knobs
from shadow.cli import build_parser, main
from shadow.commands import fleet_vllm
from shadow.commands.fleet import config_from_args
from shadow.fleet.config import FleetConfig
from tests.cli_parsers import action, subparser

KNOBS = list(knobs(FleetConfig))
#: Settings whose flag is None when not given: the engine picks (the simulated fleet: the field's
#: default; --engine vllm: 0 prefill servers, free ports).
UNSET_IS_NONE = {"--prefill", "--port"}



def _action(dest: str) -> argparse.Action:
    return action("fleet", dest)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["fleet", *argv])


def test_slots_is_one_field_and_everything_else_derives_from_it(capsys: pytest.CaptureFixture[str]) -> None:
    field = next(f for f in dataclasses.fields(FleetConfig) if f.name == "slots")
    k = field.metadata[KNOB]
    assert isinstance(k, Knob) and k.flag == "--slots" and field.default == 64
    flag = _action("slots")  # the flag: its default, type and help come from the field
    assert flag.option_strings == ["--slots"] and flag.default == 64 and flag.type is int
    assert flag.metavar == "B" and flag.help is not None and flag.help.endswith("(default 64)")
    assert "running slots per rank (default 64)" in " ".join(subparser("fleet").format_help().split())
    assert config_from_args(_args()).slots == 64 and config_from_args(_args("--slots", "16")).slots == 16
    # validated, naming the flag: by the config and by the command (exit 2, one line)
    with pytest.raises(ValueError, match=r"^--slots must be >= 1, got 0$"):
        FleetConfig(slots=0)
    with pytest.raises(ValueError, match=r"^--slots must be >= 1, got 0$"):
        config_from_args(_args("--slots", "0"))
    assert main(["fleet", "--slots", "0"]) == 2
    assert capsys.readouterr().err == "shadow fleet: --slots must be >= 1, got 0\n"


@pytest.mark.parametrize(("field", "k"), KNOBS, ids=[k.flag for _, k in KNOBS])
def test_every_setting_is_a_flag_with_the_fields_default(field: dataclasses.Field[object], k: Knob) -> None:
    action = _action(k.dest)
    assert action.option_strings == [k.flag]
    if isinstance(field.default, bool):
        assert action.default is False and isinstance(action, argparse._StoreTrueAction)
        return
    if k.flag in UNSET_IS_NONE:
        assert action.default is None
    elif k.flag != "--control-token":  # not given: the environment's token (SHADOW_FLEET_CONTROL_TOKEN)
        assert action.default == field.default
    shown = "none" if field.default is None else format(field.default, "g") if isinstance(
        field.default, float) else field.default
    assert action.help is not None and action.help.endswith(f"(default {shown})")
    if field.default is not None:
        assert action.type is type(field.default)
    # not given: the field's default reaches the config; given: the flag's value does
    assert getattr(config_from_args(_args()), field.name) == (
        field.default if k.flag != "--control-token" else _action("control_token").default)
    value = {int: "3", float: "0.5", str: "x"}.get(type(field.default), "tok")
    assert getattr(config_from_args(_args(k.flag, value)), field.name) == (action.type or str)(value)


@pytest.mark.parametrize(("field", "k"), [(f, k) for f, k in KNOBS if k.bound is not None],
                         ids=[k.flag for _, k in KNOBS if k.bound is not None])
def test_every_bound_names_its_flag(field: dataclasses.Field[object], k: Knob) -> None:
    bad = -1 if k.flag != "--time-scale" else 0
    with pytest.raises(ValueError, match=rf"^{re.escape(k.flag)} must be .*, got {bad}(\.0)?$"):
        config_from_args(_args(f"{k.flag}={bad}"))


def test_the_cli_is_as_before() -> None:
    """Defaults and special cases: --prefill / --port not given are None (the simulated fleet: 1 and
    18000; --engine vllm: 0 and free ports), --control-token from the environment, --fault repeatable."""
    args = _args()
    assert args.prefill is None and args.port is None and args.fault == []
    assert config_from_args(args) == FleetConfig(control_token=args.control_token)
    assert (FleetConfig().prefill, FleetConfig().base_port) == (1, 18000)
    assert fleet_vllm._ports(args) is None and fleet_vllm._ports(_args("--port", "0")) is None
    assert fleet_vllm._ports(_args("--port", "9000", "--prefill", "1", "--decode", "2")) == (9000, 9100, 9101)
    got = config_from_args(_args("--port", "0", "--prefill", "0", "--fault", "decode/1:slow=2"))
    assert got.base_port == 0 and got.prefill == 0 and len(got.faults) == 1
    assert fleet_vllm._sim_only(_args()) == []
    assert fleet_vllm._sim_only(_args("--time-scale", "1")) == []
    assert fleet_vllm._sim_only(_args("--time-scale", "0.5", "--dp-front", "--fault", "decode/0:slow=2")) == [
        "dp_front", "fault", "time_scale"]
    metavars = {a.dest: a.metavar for a in subparser("fleet")._actions}
    assert {d: metavars[d] for d in ("prefill", "decode", "slots", "port", "time_scale", "catch_up")} == {
        "prefill": "N", "decode": "G", "slots": "B", "port": "BASE", "time_scale": "X", "catch_up": "S"}
    assert all(metavars[d] is None for d in ("host", "control_token", "kv_tokens", "kv_ttl", "a", "b"))


def test_control_token_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHADOW_FLEET_CONTROL_TOKEN", "s3cret")
    assert config_from_args(_args()).control_token == "s3cret"
    assert config_from_args(_args("--control-token", "other")).control_token == "other"
    assert "s3cret" not in subparser("fleet").format_help()  # the help never shows the token



def test_checks_across_settings_name_their_flags() -> None:
    """What a bound cannot say stays code in `FleetConfig.__post_init__`, and names the flags too."""
    fixed = r"with a fixed --port \(0: free ports\)"
    with pytest.raises(ValueError, match=rf"^--decode must be <= 100 {fixed}, got 150$"):
        config_from_args(_args("--decode", "150"))
    config_from_args(_args("--decode", "150", "--port", "0"))  # free ports: no such limit
    with pytest.raises(ValueError, match=r"^--a and --b cannot both be 0"):
        config_from_args(_args("--a", "0", "--b", "0"))
    with pytest.raises(ValueError, match=r"^--fault target decode/5 does not exist \(decode/0\.\.1\)$"):
        config_from_args(_args("--fault", "decode/5:slow=2"))
