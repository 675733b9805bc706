"""A setting of `shadow fleet --engine vllm`'s own group is declared once (`shadow.base.knobs`): a
field of `VllmFleetConfig` holds its flag, type, default, help and bound or choices, and the command
derives from it its flag (default, type, "(default X)" in the help) and its check, which names the
flag — shown for `data_parallel` by introspection, and for every one of them (that none is written
a second time where the command builds its options: tests/cli/test_settings_once.py).

Hand-written, not knobs: `--engine` (which fleet, not a setting of one), `--vllm-venv` (its default
is $SHADOW_VLLM_VENV, else the repository's venv, looked up at run time), `--probe-url` and
`--probe-token` (their defaults are read from the environment when the parser is built). The fleet's
shape comes from the flags shared with the simulated fleet (FleetConfig's). Nothing here starts
vLLM: every command run is refused before the engine is looked for."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any, cast

import pytest

from shadow.base.knobs import KNOB, Knob, knobs
from shadow.cli import build_parser, main
from shadow.commands import fleet_vllm
from shadow.commands.fleet_vllm import config_from_args
from shadow.realvllm.launcher import DEFAULT_KV_BYTES, VllmFleetConfig
from tests.cli_parsers import action, shown, subparser

KNOBS = list(knobs(VllmFleetConfig))
VLLM = ("--engine", "vllm")



def _action(dest: str) -> argparse.Action:
    return action("fleet", dest)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["fleet", *VLLM, *argv])



def test_data_parallel_is_one_field_and_everything_else_derives_from_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    field = next(f for f in dataclasses.fields(VllmFleetConfig) if f.name == "data_parallel")
    k = field.metadata[KNOB]
    assert isinstance(k, Knob) and k.flag == "--data-parallel" and field.default == 1
    flag = _action("data_parallel")  # the flag: its default, type and help come from the field
    assert flag.option_strings == ["--data-parallel"] and flag.default == 1 and flag.type is int
    assert flag.metavar == "N" and flag.help is not None and flag.help.endswith("(default 1)")
    help_text = " ".join(subparser("fleet").format_help().split())
    assert "its /metrics labels each engine) (default 1)" in help_text
    assert config_from_args(_args()).data_parallel == 1
    assert config_from_args(_args("--data-parallel", "2")).data_parallel == 2
    # validated, naming the flag: by the config and by the command (exit 2, one line, nothing started)
    with pytest.raises(ValueError, match=r"^--data-parallel must be >= 1, got 0$"):
        VllmFleetConfig(data_parallel=0)
    with pytest.raises(ValueError, match=r"^--data-parallel must be >= 1, got 0$"):
        config_from_args(_args("--data-parallel", "0"))
    assert main(["fleet", *VLLM, "--data-parallel", "0"]) == 2
    assert capsys.readouterr().err == "shadow fleet: --data-parallel must be >= 1, got 0\n"


@pytest.mark.parametrize(("field", "k"), KNOBS, ids=[k.flag for _, k in KNOBS])
def test_every_setting_is_a_flag_with_the_fields_default(field: dataclasses.Field[object], k: Knob) -> None:
    action = _action(k.dest)
    assert action.option_strings == [k.flag]
    # not given: the field's default reaches the config
    assert getattr(config_from_args(_args()), field.name) == field.default
    if isinstance(field.default, bool):
        assert action.default is False and isinstance(action, argparse._StoreTrueAction)
        return
    assert action.default == field.default
    assert action.help is not None and action.help.endswith(f"(default {shown(field.default)})")
    choices = k.kw.get("choices")
    if choices is not None:
        assert list(action.choices or ()) == list(choices) and field.default in choices
        value: str = choices[-1]
    else:
        assert action.type is (type(field.default) if field.default is not None else Path)
        value = {int: "3", float: "0.5"}.get(type(field.default), "/tmp/x")
    # given: the flag's value does, typed
    typed = cast(Any, action.type)(value) if action.type else value
    assert getattr(config_from_args(_args(k.flag, value)), field.name) == typed


@pytest.mark.parametrize(("field", "k"), [(f, k) for f, k in KNOBS if k.bound is not None],
                         ids=[k.flag for _, k in KNOBS if k.bound is not None])
def test_every_bound_names_its_flag(field: dataclasses.Field[object], k: Knob) -> None:
    with pytest.raises(ValueError, match=rf"^{re.escape(k.flag)} must be .*, got 0(\.0)?$"):
        config_from_args(_args(f"{k.flag}=0"))
    with pytest.raises(ValueError, match=rf"^{re.escape(k.flag)} must be .*, got 0$"):
        VllmFleetConfig(**{field.name: cast(Any, 0)})


@pytest.mark.parametrize(("field", "k"), [(f, k) for f, k in KNOBS if "choices" in k.kw],
                         ids=[k.flag for _, k in KNOBS if "choices" in k.kw])
def test_every_choice_names_its_flag(field: dataclasses.Field[object], k: Knob) -> None:
    with pytest.raises(ValueError, match=rf"^{re.escape(k.flag)} must be one of .*, got 'other'$"):
        VllmFleetConfig(**{field.name: cast(Any, "other")})
    with pytest.raises(SystemExit):  # the command line: argparse's own "invalid choice"
        _args(k.flag, "other")


def test_the_cli_is_as_before() -> None:
    """Flags, defaults, types, metavars and choices of the group; the shared flags fill the shape."""
    metavars = {a.dest: a.metavar for a in subparser("fleet")._actions}
    assert {d: metavars[d] for d in ("data_parallel", "kv_bytes", "start_timeout", "model_path", "log_dir",
                                     "vllm_venv", "probe_url", "probe_token")} == {
        "data_parallel": "N", "kv_bytes": "BYTES", "start_timeout": "S", "model_path": "DIR",
        "log_dir": "DIR", "vllm_venv": "DIR", "probe_url": "URL", "probe_token": "TOKEN"}
    assert metavars["model_seed"] is None
    assert (_action("model_size").choices, _action("connector").choices) == (
        ("tiny", "mid", "moe"), ("auto", "nixl", "example"))
    assert (_action("engine").choices, _action("engine").default) == (("sim", "vllm"), "sim")
    args = _args()
    assert (args.model_seed, args.data_parallel, args.kv_bytes, args.start_timeout) == (
        0, 1, 128 << 20, 600.0)
    assert DEFAULT_KV_BYTES == 128 << 20 and isinstance(args.start_timeout, float)
    got = config_from_args(args)
    assert (got.decode, got.prefill, got.max_num_seqs, got.max_model_len, got.ports) == (2, 0, 64, 2048, None)
    assert got.venv is None and got.extra_args == ()
    got = config_from_args(_args("--prefill", "1", "--decode", "1", "--slots", "8", "--port", "9000",
                                 "--vllm-venv", "/v", "--model-path", "/m", "--log-dir", "/l",
                                 "--otlp-traces-endpoint", "http://o"))
    assert (got.prefill, got.decode, got.max_num_seqs, got.ports) == (1, 1, 8, (9000, 9100))
    assert (got.venv, got.model_path, got.log_dir) == (Path("/v"), Path("/m"), Path("/l"))
    assert got.extra_args == ("--otlp-traces-endpoint", "http://o")
    ranks = config_from_args(_args("--port", "9000", "--decode", "1", "--data-parallel", "2", "--dp-ports"))
    assert ranks.ports == (9100, 9101) and ranks.dp_ports and ranks.ranks_per_port == 2


def test_the_probe_flags_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHADOW_PROBE_URL", "http://127.0.0.1:9/")
    monkeypatch.setenv("SHADOW_PROBE_TOKEN", "s3cret")
    got = config_from_args(_args())
    assert (got.probe_url, got.probe_token) == ("http://127.0.0.1:9/", "s3cret")
    got = config_from_args(_args("--probe-url", "http://u", "--probe-token", "t"))
    assert (got.probe_url, got.probe_token) == ("http://u", "t")


def test_checks_across_settings_stay_code_and_sim_only_flags_are_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"--dp-ports\) needs .*--data-parallel\) >= 2"):
        config_from_args(_args("--dp-ports"))
    with pytest.raises(ValueError, match=r"loopback only"):
        config_from_args(_args("--host", "0.0.0.0"))
    assert fleet_vllm._sim_only(_args("--dp-front")) == ["dp_front"]
    assert main(["fleet", *VLLM, "--time-scale", "0.5"]) == 2
    assert capsys.readouterr().err == (
        "shadow fleet: --time-scale only apply to the simulated fleet (--engine sim)\n")
