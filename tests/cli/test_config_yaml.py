"""`--config` YAML (and the mode flag file) is plain data (issue #37 D5): a few hundred bytes of
aliases once expanded to gigabytes (or a MemoryError traceback) and deep nesting ended in a
RecursionError traceback; now each is a one-line error naming the file and the line, exit 2."""

from __future__ import annotations

import sys
from pathlib import Path

import hypothesis.strategies as st
import pytest
import yaml
from hypothesis import given, settings

from shadow.base.procs import shadow_argv
from shadow.base.safeyaml import MAX_DEPTH, load_yaml
from shadow.commands._layered import MAX_CONFIG_BYTES
from tests.bounded import one_line_error, run_bounded


def _laughs(levels: int, width: int = 9) -> str:
    """`policies:` holding `levels` anchored lists, each `width` aliases of the one before."""
    parts = ["&a0 [" + ",".join("x" * width) + "]"]
    parts += [f"&a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "policies: [" + ", ".join(parts) + "]\n"


CASES = {
    "9^9 values in 380 bytes of aliases": (_laughs(9), "line 1: aliases are not allowed in --config"),
    "9^10 values in 423 bytes": (_laughs(10), "line 1: aliases are not allowed in --config"),
    "an anchor alone": ("lag: 2\npolicies: &p jsq\n", "line 2: aliases are not allowed in --config"),
    "deep nesting": ("policies: " + "[" * 100_000 + "]" * 100_000 + "\n",
                     f"line 1: nested too deep (more than {MAX_DEPTH} levels, the limit)"),
    "a file too large": ("lag: 2\n" + "#" * MAX_CONFIG_BYTES + "\n", f"larger than {MAX_CONFIG_BYTES} bytes"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_config_file_costs_no_more_than_its_size(tmp_path: Path, case: str) -> None:
    text, message = CASES[case]
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    proc = run_bounded(shadow_argv("serve", "--config", str(path)))
    err = one_line_error(proc, message)
    assert err.startswith(f"shadow serve: config {path}: "), err
    assert proc.stdout == ""


def test_the_mode_file_refuses_aliases_too() -> None:
    """Its error messages once printed the aliased value (`got [...]`): the same expansion."""
    body = _laughs(9).replace("policies", "canary_fraction")
    code = ("from shadow.active.flagfile import parse_flag\n"
            f"parse_flag(b'mode: canary\\n' + {body.encode()!r}, 'flag file f')\n")
    proc = run_bounded([sys.executable, "-c", code])
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        "ValueError: flag file f: line 2: aliases are not allowed in the mode file (write the value out)"
    ), proc.stderr[-2000:]


def test_a_plain_config_still_loads(tmp_path: Path) -> None:
    doc = b"lag: 2.5\npolicies: [jsq, br0]\nfront:\n  router: http://127.0.0.1:8000\n<<: {slots: 8}\n"
    assert load_yaml(doc, "config x", "--config") == yaml.safe_load(doc)
    assert load_yaml(b"", "config x", "--config") is None
    nested = b"a: " + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1)
    assert load_yaml(nested, "config x", "--config") == yaml.safe_load(nested)


FRAGMENTS = ["&a ", "*a", "&b [1, *a]", "[", "]", "{", "}", ": ", "- ", "? ", ",", "\n", "  ", "\t", "'", '"',
             "!!binary ", "!!timestamp ", "2001-13-45", "9" * 5000, "<<: ", "<<: *a", "%YAML 1.1\n", "---\n",
             "!!python/object:os.system ", "...\n", "!!set ", "!!omap ", "!!float ", "1e999", "\x00",
             "\ufeff", "#"]


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12)), max_size=30))
def test_the_loader_raises_nothing_but_its_one_line_error(parts: list[str]) -> None:
    raw = "".join(parts).encode("utf-8", "surrogatepass")
    try:
        data = load_yaml(raw, "config x.yaml", "--config")
    except ValueError as exc:
        message = str(exc)
        assert message.startswith("config x.yaml:") and "\n" not in message, message
    else:
        # what it takes, it reads as PyYAML does
        assert repr(data) == repr(yaml.safe_load(raw.decode("utf-8")))
