"""A setting is declared once (`shadow.base.knobs`): `shadow serve`'s settings are fields of the
configs that use them (`serve_checks.DECLARED`: the live lanes' `LanesConfig` through `ServeConfig`,
which `LiveLanes` takes its defaults from, the active proxy's
`ActiveConfig`, the mode controller's `ModeConfig`, the fallback's `GuardConfig`, the client-felt
checks' `ClientConfig`, the canary's `CanaryConfig`, the data plane's `RelayBounds` and `TapLimits`
shared with `shadow tap`, the mirror's `MirrorConfig`, the active listener's `ActiveSettings` and the
lease's `LeaseSettings`), and the command derives from them their flags
(default and help), their YAML keys and environment variables (through the layered options), and
their checks — shown here for `transfer_cap` by introspection, and for every one of them; and no
flag of theirs is written a second time where serve builds its options. Likewise `shadow fleet`'s
settings, fields of `FleetConfig` (tests/fleet/test_fleet_settings_once.py), and its `--engine vllm`
group's, fields of `VllmFleetConfig` (tests/fleet/test_vllm_settings_once.py): no flag of theirs is
written a second time where fleet builds its options. And `shadow load`'s, fields of `LoadOptions`
(tests/loadgen/test_load_settings_once.py); `shadow router`'s, fields of `RouterConfig` and of the
command's `Listen` (tests/cli/test_router_settings_once.py); the steady-state protocol's of `shadow
sweep` and `shadow replay --steady`, fields of `Protocol` (tests/cli/test_sweep_settings_once.py)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

import shadow
from shadow.active.proxy import ActiveConfig
from shadow.active.standin import RouterConfig
from shadow.base.knobs import KNOB, Knob, knobs
from shadow.commands.router import Listen
from shadow.commands.serve import active_settings, build_parser, config_from_args, resolve_args
from shadow.commands.serve_checks import DECLARED
from shadow.fleet.config import FleetConfig
from shadow.loadgen.options import LoadOptions
from shadow.realvllm.launcher import VllmFleetConfig
from shadow.replay.protocol import Protocol

BASE = ["--upstream", "d0=http://127.0.0.1:1", "--active"]
KNOBS = [(cls, f, k) for cls in DECLARED for f, k in knobs(cls)]


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


@pytest.mark.parametrize(("cls", "field", "k"), KNOBS, ids=[k.flag for _, _, k in KNOBS])
def test_every_declared_setting_is_a_flag_a_yaml_key_and_an_env_variable(
    cls: type, field: dataclasses.Field[object], k: Knob, tmp_path: Path
) -> None:
    action = _action(k.dest)
    assert action.option_strings == [k.flag] and action.default == field.default
    none = "8192" if action.type is int else "http://127.0.0.1:1"  # of its type, where None is the default
    value = {bool: "1", type(None): none}.get(type(field.default), str(field.default))
    env = f"SHADOW_SERVE_{k.dest.upper()}"
    args = resolve_args(_explicit(BASE), {env: value})
    assert args.option_sources[k.dest] == f"env {env}"
    yaml_file = tmp_path / "serve.yaml"
    yaml_file.write_text(f"{k.dest}: {value}\n")
    from_yaml = resolve_args(_explicit([*BASE, "--config", str(yaml_file)]), {})
    assert from_yaml.option_sources[k.dest] == f"config {yaml_file}"
    typed = True if isinstance(field.default, bool) else action.type(value) if action.type else value
    assert getattr(from_yaml, k.dest) == getattr(args, k.dest) == typed
    if cls is ActiveConfig:  # the proxy's settings reach it by field name
        settings = active_settings(args)
        assert settings is not None and settings.settings[field.name] == getattr(args, k.dest)


def test_no_declared_setting_is_written_again_where_serve_builds_its_options() -> None:
    """grep: no `flag("--X"` or `add_argument("--X"` for a declared setting in the modules that build
    `shadow serve`'s options and config (another command may have a flag of the same spelling for a
    setting of its own: `shadow demo --step-a` is the simulated fleet's step)."""
    root = Path(shadow.__file__).parent
    src = "\n".join((root / m).read_text() for m in (
        "commands/serve.py", "commands/serve_checks.py", "commands/tap.py", "commands/_flags.py",
        "app/serve.py", "active/proxy.py", "active/cohorts.py", "active/canary.py", "active/fallback.py",
        "active/modes.py", "app/tap.py", "mirror/service.py", "mirror/link.py", "mirror/config.py",
        "active/proxyconfig.py", "active/wiring.py", "live/config.py", "live/lanes.py"))
    # `shadow tap`'s own --port (its first tap's port; serve's is its API's): declared in `group_flags`,
    # which serve does not use, and given to the tap group serve starts (API port + 1)
    others = {"--port": 1}
    for _, _, k in KNOBS:
        declared = re.findall(r'(?:flag|add_argument)\(\s*"' + re.escape(k.flag) + '"', src)
        assert len(declared) == others.get(k.flag, 0), k.flag
        # nor spelt into a command line by hand (the tap group serve starts: `knob_argv`)
        spelt = re.findall('"' + re.escape(k.flag) + r'",\s*(?:str\(|f")', src)
        assert len(spelt) == others.get(k.flag, 0), k.flag


def _sources(*modules: str) -> str:
    """The text of `shadow`'s modules (paths below the package)."""
    root = Path(shadow.__file__).parent
    return "\n".join((root / m).read_text() for m in modules)


def _written_again(src: str, *classes: type, spelt: bool = False, read: bool = False) -> list[str]:
    """The flags of `classes`' knobs that `src` declares again (`add_argument("--X"`, `flag("--X"`),
    and with `spelt` that it spells into a command line (`"--X", str(` / `"--X", f"`), and with
    `read` that it reads off the parsed flags by hand (`args.x`, not through `knob_values`)."""
    out = []
    for cls in classes:
        for _, k in knobs(cls):
            if re.findall(r'(?:flag|add_argument)\(\s*"' + re.escape(k.flag) + '"', src):
                out.append(f"{k.flag} declared again")
            if spelt and re.findall('"' + re.escape(k.flag) + r'",\s*(?:str\(|f")', src):
                out.append(f"{k.flag} spelt into a command line")
            if read and f"args.{k.dest}" in src:
                out.append(f"{k.flag} read as args.{k.dest}")
    return out


def test_no_setting_is_written_again_where_fleet_builds_its_options() -> None:
    """grep: no `add_argument("--X"` for a FleetConfig setting, no "(default N)" of one written by
    hand, nor its flag spelt into a command line, in the modules that build `shadow fleet`'s options
    and config."""
    src = _sources("commands/fleet.py", "commands/fleet_vllm.py", "fleet/config.py")
    assert _written_again(src, FleetConfig, spelt=True) == []
    # the fleet's defaults are nowhere in a help text written by hand
    assert not re.search(r"\(default (1|2|64|127\.0\.0\.1|18000|sim-llm)[;)]", src)
    assert "1.0)" not in src  # --engine vllm's check of the sim-only options takes the field's default


def test_no_real_engine_setting_is_written_again_where_fleet_builds_its_options() -> None:
    """grep: no `add_argument("--X"` for a VllmFleetConfig setting, no "(default X)" or "default X" of
    one written by hand, nor its flag spelt into a command line, where `shadow fleet --engine vllm`
    builds its options and config (the launcher's own `vllm serve` flags, `--data-parallel-size`
    and the like, are vLLM's)."""
    src = _sources("commands/fleet.py", "commands/fleet_vllm.py", "realvllm/launcher.py")
    assert _written_again(src, VllmFleetConfig, spelt=True) == []
    assert not re.search(r"default:? (0|1|600|tiny|auto|128 MiB|a new temporary)\b", src)


def test_no_load_setting_is_written_again_where_load_builds_its_options() -> None:
    """grep: no `add_argument("--X"` for a LoadOptions setting, nor a "default X" of one written by
    hand, where `shadow load` builds its options."""
    src = _sources("commands/load.py", "loadgen/options.py")
    assert _written_again(src, LoadOptions) == []
    assert not re.search(r"default:? (EMPTY|1|600|no cap|first id)\b", src)
    assert "SAME_NAME" not in src  # the options' fields are read through their knobs (`knob_values`)


def test_no_router_setting_is_written_again_where_router_builds_its_options() -> None:
    """grep: no `add_argument("--X"` for a RouterConfig or Listen setting, no "(default X)" of one
    written by hand, nor its value read off the parsed flags by hand, where `shadow router` builds its
    options and config."""
    src = _sources("commands/router.py", "active/standin.py")
    assert _written_again(src, RouterConfig, Listen, read=True) == []
    assert not re.search(r"default:? (jsq-bytes|3|1024|8000|8388608|127\.0\.0\.1)\)", src)
    assert "default=" not in src


def test_no_protocol_setting_is_written_again_where_sweep_and_replay_build_their_options() -> None:
    """grep: no `add_argument("--X"` for a Protocol setting, no "(default X)" of one written by hand,
    nor its value read off the parsed flags by hand, where `shadow sweep` and `shadow replay` build
    their options and the protocol."""
    src = _sources("commands/sweep.py", "commands/replay.py", "commands/sweep_protocol.py",
                   "commands/_replay_args.py", "replay/protocol.py")
    assert _written_again(src, Protocol, read=True) == []
    assert not re.search(r"\(default (3|5|40,?000)\)", src)


#: LiveLanes' parameters and the `LanesConfig` settings they are.
LANE_PARAMETERS = {"lag_s": "lag_s", "step_source": "step_source", "lane_clock": "lane_clock",
                   "queue_size": "live_queue_size", "window_s": "step_window_s",
                   "compare_window_s": "compare_window_s"}


def test_the_live_lanes_take_their_defaults_from_the_declarations() -> None:
    """`LiveLanes`' defaults are `LanesConfig`'s, referred to, not written again (grep: no literal
    default for these parameters in its signature), and `LiveDriver`'s lag is the same constant."""
    import inspect

    from shadow.engine.live import DEFAULT_LAG_S, LiveDriver
    from shadow.live.config import LanesConfig
    from shadow.live.lanes import LiveLanes

    params = inspect.signature(LiveLanes.__init__).parameters
    declared = {f.name: f.default for f in dataclasses.fields(LanesConfig)}
    for param, name in LANE_PARAMETERS.items():
        assert params[param].default == declared[name], param
    src = inspect.getsource(LiveLanes.__init__).split(") -> None:")[0]
    for param, name in LANE_PARAMETERS.items():
        assert re.search(rf"\b{param}: [\w| ]+ = LanesConfig\.{name},", src), param
    driver = inspect.signature(LiveDriver.__init__).parameters
    assert declared["lag_s"] == DEFAULT_LAG_S == driver["lag_s"].default
    from shadow.live.stepfit import DEFAULT_SOURCE, WINDOW_S, StepEstimator

    estimator = inspect.signature(StepEstimator.__init__).parameters
    assert declared["step_window_s"] == WINDOW_S == estimator["window_s"].default
    assert declared["step_source"] == DEFAULT_SOURCE == estimator["source"].default
