"""A setting is declared once (`shadow.base.knobs`): the active proxy's settings are fields of
`ActiveConfig`, and `shadow serve` derives from them their flags (default and help), their YAML
keys and environment variables (through the layered options), and their checks — shown here for
`transfer_cap` by introspection, and for every one of them; and no flag of theirs is written a
second time anywhere in `shadow/`."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

import shadow
from shadow.active.proxy import ActiveConfig
from shadow.base.knobs import KNOB, Knob, knobs
from shadow.commands.serve import active_settings, build_parser, config_from_args, resolve_args

BASE = ["--upstream", "d0=http://127.0.0.1:1", "--active"]
KNOBS = [(f.name, k) for f, k in knobs(ActiveConfig)]


def _action(dest: str) -> argparse.Action:
    return next(a for a in build_parser()._actions if a.dest == dest)


def _explicit(argv: list[str]) -> dict[str, object]:
    """What `shadow serve ARGV` gives explicitly (as `run` does before layering)."""
    from shadow.commands.serve import _parser

    p = _parser(argparse.ArgumentParser(), explicit=True)
    return {k: v for k, v in vars(p.parse_args(argv)).items()}


def test_transfer_cap_is_one_field_and_everything_else_derives_from_it(tmp_path: Path) -> None:
    field = next(f for f in dataclasses.fields(ActiveConfig) if f.name == "transfer_cap")
    k = field.metadata[KNOB]
    assert isinstance(k, Knob) and k.flag == "--transfer-cap" and field.default == 8
    flag = _action("transfer_cap")  # the flag: its default and help come from the field
    assert flag.option_strings == ["--transfer-cap"] and flag.default == 8 and flag.type is int
    assert flag.help is not None and flag.help.endswith("(default 8)")
    # a YAML key, an environment variable and the flag, in that order of precedence, reach the proxy
    config = tmp_path / "serve.yaml"
    config.write_text("transfer_cap: 3\n")
    for explicit, env, want in ((["--config", str(config)], {}, 3),
                                (["--config", str(config)], {"SHADOW_SERVE_TRANSFER_CAP": "5"}, 5),
                                ([*BASE, "--transfer-cap", "7"], {"SHADOW_SERVE_TRANSFER_CAP": "5"}, 7)):
        args = resolve_args(_explicit([*BASE, *explicit]), env)
        settings = active_settings(args)
        assert settings is not None and settings.settings["transfer_cap"] == want, (explicit, env)
        assert ActiveConfig(decode={"d0": "http://x"}, slots=1, **settings.settings).transfer_cap == want
    # validated where it came from, naming the flag and the source
    args = resolve_args(_explicit(BASE), {"SHADOW_SERVE_TRANSFER_CAP": "0"})
    where = r"\(from env SHADOW_SERVE_TRANSFER_CAP\)"
    with pytest.raises(ValueError, match=rf"^--transfer-cap {where} must be >= 1, got 0$"):
        config_from_args(args)
    with pytest.raises(ValueError, match=r"^--transfer-cap must be >= 1, got 0$"):
        ActiveConfig(decode={"d0": "http://x"}, slots=1, transfer_cap=0)


@pytest.mark.parametrize(("name", "k"), KNOBS, ids=[n for n, _ in KNOBS])
def test_every_setting_of_the_proxy_is_a_flag_a_yaml_key_and_an_env_variable(name: str, k: Knob) -> None:
    field = next(f for f in dataclasses.fields(ActiveConfig) if f.name == name)
    action = _action(k.dest)
    assert action.option_strings == [k.flag]
    assert action.default == field.default or (field.default is False and action.default is False)
    value = "1" if isinstance(field.default, bool) else str(field.default)
    args = resolve_args(_explicit(BASE), {f"SHADOW_SERVE_{k.dest.upper()}": value})
    settings = active_settings(args)
    assert settings is not None and name in settings.settings
    assert args.option_sources[k.dest] == f"env SHADOW_SERVE_{k.dest.upper()}"


def test_no_setting_of_the_proxy_is_declared_twice() -> None:
    """grep: no `flag("--X"` or `add_argument("--X"` for a setting of `ActiveConfig` in shadow/."""
    src = "\n".join(p.read_text() for p in Path(shadow.__file__).parent.rglob("*.py"))
    for _, k in KNOBS:
        declared = re.findall(r'(?:flag|add_argument)\(\s*"' + re.escape(k.flag) + '"', src)
        assert declared == [], k.flag
