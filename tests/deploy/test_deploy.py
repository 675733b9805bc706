"""deploy/: the kustomize overlay builds, validates offline against Kubernetes schemas, the generated
PrometheusRule and dashboard ConfigMaps match alerts/ and dashboards/, the bare-metal Prometheus and
Alertmanager configs check, and systemd accepts the hardened units (the analysis, and the data plane's
socket and service).

Not checked offline: the ServiceMonitor and PrometheusRule against their CRD schemas (none ship
with kubernetes-validate); the PrometheusRule's groups are checked with promtool instead, and the
ServiceMonitor's fields by hand below.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from shadow.base.tools import find_executable
from tests.harness import stop_tap_groups

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.32.0"


def _tool(name: str, package: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        pytest.fail(f"{name} is missing (apt-get install -y {package})")
    return exe


def _build(path: Path) -> list[dict[str, Any]]:
    res = subprocess.run([_tool("kubectl", "kubectl"), "kustomize", str(path)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


@pytest.fixture(scope="module")
def built() -> list[dict[str, Any]]:
    return _build(K8S / "overlays" / "example")


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in found])
    return found[0]


def test_overlay_builds_every_object(built: list[dict[str, Any]]) -> None:
    kinds = sorted(d["kind"] for d in built)
    assert kinds.count("ConfigMap") == 9  # 8 dashboards + the sidecar config
    for kind in ("Deployment", "Service", "ServiceMonitor", "PrometheusRule", "NetworkPolicy", "Secret"):
        assert kind in kinds, kind
    assert {d["metadata"].get("namespace") for d in built} == {"llm-serving"}


def test_core_objects_validate_strictly_against_kubernetes_schemas(built: list[dict[str, Any]]) -> None:
    core = [d for d in built if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert len(core) == len(built) - 3  # two ServiceMonitors and the PrometheusRule
    for doc in core:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_validation_can_fail(built: list[dict[str, Any]]) -> None:
    deploy = _one(built, "Deployment")
    bad = yaml.safe_load(yaml.safe_dump(deploy))
    bad["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_sidecar_is_native_nonroot_readonly(built: list[dict[str, Any]]) -> None:
    spec = _one(built, "Deployment", "router")["spec"]["template"]["spec"]
    (side,) = [c for c in spec["initContainers"] if c["name"] == "shadow"]
    assert side["restartPolicy"] == "Always"
    assert side["image"] == _image_tag()  # what deploy/image/build.sh builds
    assert side["args"][0] == "serve"
    sc = side["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert f"{sc['runAsUser']}:{sc['runAsGroup']}" == _containerfile("USER")  # the image's own user
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert "readinessProbe" not in side  # shadow mode: never take the router's Pod out of its Service
    assert [c["name"] for c in spec["containers"]] == ["router"]  # the router itself is untouched
    ports = {p["name"] for p in side["ports"]}
    svc = _one(built, "Service", "shadow")
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
    mon = _one(built, "ServiceMonitor", "shadow")
    assert {e["port"] for e in mon["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert all(e["path"] == "/metrics" for e in mon["spec"]["endpoints"])
    pol = _one(built, "NetworkPolicy", "shadow")
    allowed = {p["port"] for rule in pol["spec"]["ingress"] for p in rule["ports"]}
    assert "shadow-api" in allowed and "http" in allowed  # the router's own port stays reachable
    # the data plane: a native sidecar of its own, on the same state volume, scraped as `shadow-tap`
    (tap,) = [c for c in spec["initContainers"] if c["name"] == "shadow-tap"]
    assert tap["restartPolicy"] == "Always" and tap["args"][0] == "tap" and "readinessProbe" not in tap
    assert tap["image"] == side["image"] and tap["securityContext"] == sc
    shared = {m["name"] for m in tap["volumeMounts"]} & {m["name"] for m in side["volumeMounts"]}
    assert shared == {"shadow-state"}
    assert "--attach=/var/lib/shadow/taps/router" in side["args"] and "--name=router" in tap["args"]
    tap_svc = _one(built, "Service", "shadow-tap")
    assert {p["targetPort"] for p in tap_svc["spec"]["ports"]} <= {p["name"] for p in tap["ports"]}
    tap_mon = _one(built, "ServiceMonitor", "shadow-tap")
    assert tap_mon["spec"]["selector"]["matchLabels"].items() <= tap_svc["metadata"]["labels"].items()
    assert "tap-metrics" in allowed and "shadow-front" in {p["name"] for p in tap["ports"]}


def _image_tag() -> str:
    res = subprocess.run([str(ROOT / "deploy" / "image" / "build.sh"), "--print-tag"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def _containerfile(instruction: str) -> str:
    """The argument of the runtime stage's last `instruction` in deploy/image/Containerfile."""
    text = (ROOT / "deploy" / "image" / "Containerfile").read_text().replace("\\\n", " ")
    final = text.rsplit("\nFROM ", 1)[1]
    (arg,) = [ln.split(None, 1)[1] for ln in final.splitlines() if ln.startswith(instruction + " ")][-1:]
    return arg.strip()


def _key_path(side: dict[str, Any], spec: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """Where `shadow serve` in the sidecar keeps the prompt-key secret (resolved as it does, from the
    container's environment), and the volume mounted there."""
    from shadow.mirror.keys import key_location

    env = {e["name"]: e["value"] for e in side["env"] if "value" in e}
    loc = key_location(None, None, {"HOME": "/nonexistent", **env})
    assert loc.explicit  # named by the manifest, never the $HOME default of a read-only filesystem
    mounts = [m for m in side["volumeMounts"] if loc.path.is_relative_to(m["mountPath"])]
    assert len(mounts) == 1, (loc, side["volumeMounts"])
    (vol,) = [v for v in spec["volumes"] if v["name"] == mounts[0]["name"]]
    return loc.path, {**vol, "readOnly": mounts[0].get("readOnly", False), "at": mounts[0]["mountPath"]}


@pytest.mark.parametrize("overlay", ["example", "active"])
def test_the_prompt_key_lives_in_the_state_directory_on_an_emptydir(overlay: str) -> None:
    from shadow.mirror.keys import KEY_FILE_NAME

    spec, side = _sidecar(_build(K8S / "overlays" / overlay))
    path, vol = _key_path(side, spec)
    assert path == Path(_containerfile("ENV").split("SHADOW_STATE_DIR=")[1].split()[0]) / KEY_FILE_NAME
    assert "emptyDir" in vol and not vol["readOnly"]  # writable although the root filesystem is not


def test_the_prompt_key_secret_component_mounts_a_secret_read_only(tmp_path: Path) -> None:
    import os

    from shadow.mirror.keys import KEY_FILE_NAME

    rel = {k: os.path.relpath(v, tmp_path) for k, v in
           (("overlay", K8S / "overlays" / "example"), ("key", K8S / "components" / "prompt-key-secret"))}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [rel["overlay"]], "components": [rel["key"]]}))
    docs = _build(tmp_path)
    spec, side = _sidecar(docs)
    for doc in docs:
        if not doc["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    path, vol = _key_path(side, spec)
    assert vol["readOnly"] and vol["secret"]["secretName"] == "shadow-prompt-key"
    (item,) = vol["secret"]["items"]
    assert path == Path(vol["at"]) / item["path"] and item["key"] == KEY_FILE_NAME
    assert vol["secret"]["defaultMode"] & 0o004  # readable by the sidecar's user without an fsGroup


def test_the_systemd_unit_keeps_the_prompt_key_in_its_state_directory() -> None:
    import shlex

    from shadow.cli import build_parser
    from shadow.commands.serve import resolve_args
    from shadow.mirror.keys import KEY_FILE_NAME, key_location

    unit = (ROOT / "deploy" / "systemd" / "shadow-serve.service").read_text().splitlines()
    assert {"StateDirectory=shadow", "ProtectSystem=strict", "ProtectHome=yes", "DynamicUser=yes"} <= set(
        unit)
    env = {"HOME": "/", "STATE_DIRECTORY": "/var/lib/shadow"}  # as systemd sets them for this unit
    for line in (ROOT / "deploy" / "systemd" / "shadow-serve.default").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, _, v = line.partition("=")
            env[k] = shlex.split(v)[0] if v.startswith('"') else v
    args = build_parser().parse_args(["serve", *shlex.split(env.pop("SHADOW_ARGS"))])
    merged = resolve_args({k: v for k, v in vars(args).items() if k not in ("func", "command")}, env)
    loc = key_location(merged.key_file, merged.state_dir, env)
    assert loc.explicit and loc.path == Path("/var/lib/shadow") / KEY_FILE_NAME


def test_prometheusrule_is_the_alert_rules_and_passes_promtool(built: list[dict[str, Any]],
                                                              tmp_path: Path) -> None:
    rule = _one(built, "PrometheusRule", "shadow")
    groups: list[Any] = []
    for path in sorted((ROOT / "alerts" / "rules").glob("*.yaml")):
        groups += yaml.safe_load(path.read_text())["groups"]
    assert rule["spec"]["groups"] == groups
    out = tmp_path / "rules.yaml"
    out.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    res = subprocess.run([_tool("promtool", "prometheus"), "check", "rules", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_dashboard_configmaps_carry_the_committed_dashboards(built: list[dict[str, Any]]) -> None:
    maps = [d for d in built
            if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("shadow-dashboard-")]
    files = {p.name: p.read_text() for p in (ROOT / "dashboards").glob("*.json")}
    assert {k for m in maps for k in m["data"]} == set(files)
    for m in maps:
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert m["metadata"]["annotations"]["grafana_folder"]
        for name, text in m["data"].items():
            assert text == files[name]


def test_bare_metal_prometheus_and_alertmanager_configs_check(tmp_path: Path) -> None:
    conf = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    rules = tmp_path / "rules"
    rules.mkdir()
    for p in (ROOT / "alerts" / "rules").glob("*.yaml"):
        shutil.copy(p, rules / p.name)
    conf["rule_files"] = [str(rules / "*.yaml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(conf))
    res = subprocess.run([_tool("promtool", "prometheus"), "check", "config",
                          str(tmp_path / "prometheus.yml")], capture_output=True, text=True)
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr
    res = subprocess.run([_tool("amtool", "prometheus-alertmanager"), "check-config",
                          str(ROOT / "deploy" / "alertmanager" / "alertmanager.yml")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def _verify(text: str, unit: Path, *also: Path) -> None:
    """`systemd-analyze verify` accepts the unit (binary path pointed at this environment's shadow,
    since verify checks that ExecStart is executable) and `security` rates it under 2.0."""
    shadow = find_executable("shadow")
    assert shadow, "the shadow console script is neither beside the interpreter nor on PATH"
    unit.write_text(text.replace("/opt/shadow/venv/bin/shadow", shadow))
    analyze = _tool("systemd-analyze", "systemd")
    res = subprocess.run([analyze, "verify", str(unit), *map(str, also)], capture_output=True, text=True)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr
    res = subprocess.run([analyze, "security", "--offline=true", "--threshold=20", str(unit)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr


def test_systemd_units_verify_and_are_hardened(tmp_path: Path) -> None:
    """shadow-serve (the analysis) never requires the taps or the router; shadow-tap@ (the data
    plane) runs on its socket unit's socket, restarts always, reloads (the upgrade) with SIGHUP."""
    systemd = ROOT / "deploy" / "systemd"
    serve = (systemd / "shadow-serve.service").read_text()
    assert "ExecStart=/opt/shadow/venv/bin/shadow serve" in serve and "Restart=always" in serve
    assert not any(line.startswith(("BindsTo=", "Requires=")) for line in serve.splitlines())
    _verify(serve, tmp_path / "shadow-serve.service")
    tap = (systemd / "shadow-tap@.service").read_text()
    assert "ExecStart=/opt/shadow/venv/bin/shadow tap --name %i" in tap and "Restart=always" in tap
    assert "ExecReload=/bin/kill -HUP $MAINPID" in tap
    sock = (systemd / "shadow-tap@.socket").read_text()
    assert "FileDescriptorName=%i" in sock and "Service=shadow-tap@%i.service" in sock
    (tmp_path / "shadow-tap@.socket").write_text(sock)
    (tmp_path / "shadow-tap@.service").write_text(tap)
    _verify(tap, tmp_path / "shadow-tap@d0.service", tmp_path / "shadow-tap@d0.socket")


def test_the_systemd_tap_defaults_configure_shadow_tap() -> None:
    import shlex

    from shadow.cli import build_parser
    from shadow.commands.tap import config_from_args

    line = next(x for x in (ROOT / "deploy" / "systemd" / "shadow-tap.default").read_text().splitlines()
                if x.startswith("SHADOW_TAP_ARGS="))
    argv = ["tap", "--name", "d0", *shlex.split(shlex.split(line.partition("=")[2])[0])]
    config = config_from_args(build_parser().parse_args(argv))
    config.validate()
    assert list(config.upstreams) == ["d0"] and config.group_name() == "d0" and config.metrics_port == 9409


def _serve_config_of(argv: list[str], environ: dict[str, str]) -> Any:
    """What `shadow <argv>` would run, resolved exactly as the CLI does (flags, file, environment),
    without starting anything (the example addresses are never contacted)."""
    from shadow.cli import build_parser
    from shadow.commands.serve import config_from_args, resolve_args

    args = build_parser().parse_args(argv)
    explicit = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    config = config_from_args(resolve_args(explicit, environ))
    config.validate()
    return config


def test_the_sidecar_args_and_example_config_configure_shadow_serve(
    built: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHADOW_EVENTS_TOKEN", "t")  # as the Pod sets it from the Secret
    spec = _one(built, "Deployment", "router")["spec"]["template"]["spec"]
    (side,) = [c for c in spec["initContainers"] if c["name"] == "shadow"]
    example = K8S / "overlays" / "example" / "config.yaml"
    argv = [a.replace("/etc/shadow/config.yaml", str(example)) for a in side["args"]]
    config = _serve_config_of(argv, {"SHADOW_EVENTS_TOKEN": "t"})
    assert config.tap.host == "0.0.0.0" and config.tap.port == 9400
    assert config.tap.front == {"router": "http://127.0.0.1:8000"}
    assert set(config.tap.workers) == {"d0", "d1"} and config.tap.slots == 256
    assert config.policies == ("jsq-bytes", "br0", "brh:survival")
    assert config.tap.events_token == "t"


def test_the_systemd_defaults_configure_shadow_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    import shlex

    env: dict[str, str] = {}
    for line in (ROOT / "deploy" / "systemd" / "shadow-serve.default").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, _, v = line.partition("=")
            env[k] = shlex.split(v)[0] if v.startswith('"') else v
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # as systemd's EnvironmentFile= sets them
    config = _serve_config_of(["serve", *shlex.split(env.pop("SHADOW_ARGS"))], env)
    assert config.tap.port == 9400 and set(config.tap.upstreams) == {"d0", "d1"}
    assert config.tap.attach == ("/var/lib/shadow/taps/d0", "/var/lib/shadow/taps/d1")  # the taps' units
    assert config.tap.relay == "process" and config.tap.events_token == env["SHADOW_EVENTS_TOKEN"]


# --- active routing overlay, and the ports the real sidecar listens on ---------------------------

ACTIVE = K8S / "overlays" / "active"


@pytest.fixture(scope="module")
def built_active() -> list[dict[str, Any]]:
    return _build(ACTIVE)


def _sidecar(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = _one(docs, "Deployment", "router")["spec"]["template"]["spec"]
    (side,) = [c for c in spec["initContainers"] if c["name"] == "shadow"]
    return spec, side


def _serve_options() -> set[str]:
    from shadow.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {o for a in sub.choices["serve"]._actions for o in a.option_strings}


def _needs_active() -> None:
    missing = {"--active", "--active-port", "--mode-file", "--admin-token"} - _serve_options()
    if missing:
        pytest.skip(f"shadow serve has no {sorted(missing)} yet (issue 10: the active proxy and the mode "
                    "controller); the active overlay's flags are checked once they exist")


def test_active_overlay_builds_validates_and_wires_mode_file_and_admin_token(
    built_active: list[dict[str, Any]],
) -> None:
    core = [d for d in built_active if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    for doc in core:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    spec, side = _sidecar(built_active)
    assert "--active" in side["args"] and "--mode-file=/etc/shadow-mode/mode.yaml" in side["args"]
    env = {e["name"]: e for e in side["env"]}
    ref = env["SHADOW_SERVE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    secret = _one(built_active, "Secret", ref["name"])
    assert ref["key"] in secret["data"] and "--admin-token" not in " ".join(side["args"])  # not in ps
    (mount,) = [m for m in side["volumeMounts"] if m["mountPath"] == "/etc/shadow-mode"]
    assert mount["readOnly"] and "subPath" not in mount  # a subPath mount never sees ConfigMap updates
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    mode = _one(built_active, "ConfigMap", vol["configMap"]["name"])
    assert mode["metadata"]["name"] == "shadow-mode"  # no hash suffix: edits reach the Pod, no restart
    assert yaml.safe_load(mode["data"]["mode.yaml"]) == {"mode": "shadow"}
    sc = side["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]


def test_active_overlay_configures_shadow_serve(built_active: list[dict[str, Any]], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_active()
    _, side = _sidecar(built_active)
    argv = _local_argv(side["args"], built_active, tmp_path)
    environ = {"SHADOW_EVENTS_TOKEN": "t", "SHADOW_SERVE_ADMIN_TOKEN": "an-admin-token-of-32-characters!"}
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    config = _serve_config_of(argv, environ)
    assert set(config.tap.upstreams) == {"d0", "d1"} and config.tap.front == {"router": "http://127.0.0.1:8000"}
    modes = config.mode_config
    assert modes is not None and modes.admin_token == environ["SHADOW_SERVE_ADMIN_TOKEN"]
    assert modes.mode_file == str(tmp_path / "mode.yaml") and modes.mode == "shadow"  # front: shadow first
    assert config.active is not None and config.active.policy == "br0" and config.active.port == 8080


def _local_argv(args: list[str], docs: list[dict[str, Any]], tmp: Path) -> list[str]:
    """The sidecar's args with its mounted files written to `tmp` from the built ConfigMaps."""
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    config = next(v["config.yaml"] for k, v in maps.items() if k.startswith("shadow-config"))
    (tmp / "config.yaml").write_text(config)
    if "shadow-mode" in maps:
        (tmp / "mode.yaml").write_text(maps["shadow-mode"]["mode.yaml"])
    return [a.replace("/etc/shadow/config.yaml", str(tmp / "config.yaml"))
            .replace("/etc/shadow-mode/mode.yaml", str(tmp / "mode.yaml")) for a in args]


def _free_run(n: int) -> int:
    """A base port with `n` free consecutive ports after it (loopback)."""
    import random
    import socket

    for _ in range(200):
        base = random.randrange(20000, 60000 - n)
        socks = []
        try:
            for p in range(base, base + n + 1):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no run of free ports")


def _listening(argv: list[str], tmp: Path, env: dict[str, str], base: int | None = None) -> dict[str, Any]:
    """Start the real `shadow <argv>` (loopback, a free port run or `base`), return its ready line,
    stop it."""
    import json
    import os
    import sys

    shadow = find_executable("shadow")
    assert shadow, "the shadow console script is missing"
    last = ""
    for _ in range(5 if base is None else 1):  # a port of the run may be taken meanwhile: try another
        base = base or _free_run(8)
        moved = ("--host=", "--port=", "--active-host=", "--active-port=")
        args = [a for a in argv if not a.startswith(moved)]
        # reconciliation off (the example addresses are never contacted); --active refuses that
        # (it would blind the fallback checks): a long interval instead
        args += ["--host=127.0.0.1", f"--port={base}",
                 "--scrape-interval=" + ("3600" if "--active" in args else "0")]
        if "--active" in args:
            args += ["--active-host=127.0.0.1", f"--active-port={base + 7}"]
        proc = subprocess.Popen([shadow, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **env, "OTEL_SDK_DISABLED": "true"}, cwd=tmp)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip():
                ready: dict[str, Any] = json.loads(line)
                ready["base"] = base
                return ready
        finally:
            proc.terminate()
            try:
                _, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if "SHADOW_STATE_DIR" in env:  # the tap group it started outlives it: stop it too
                stop_tap_groups(Path(env["SHADOW_STATE_DIR"]))
        last = err
        if "in use" not in err:
            break
    print(last, file=sys.stderr)
    raise AssertionError(f"shadow serve did not start: {last[-1000:]}")


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def _tap_container(spec: dict[str, Any]) -> dict[str, Any]:
    (tap,) = [c for c in spec["initContainers"] if c["name"] == "shadow-tap"]
    return tap


@pytest.mark.parametrize("overlay", ["example", "active"])
def test_the_real_sidecar_listens_on_the_declared_container_ports(overlay: str, tmp_path: Path) -> None:
    """Run the data plane (`shadow tap`) and the analysis (`shadow serve`, attached to it through the
    shared state directory) with the overlay's own args (only hosts and ports moved to a free
    loopback run): clients' port `shadow-front` is the front tap (example) or shadow's proxy
    (active), the API is `shadow-api`, the data plane's /metrics `tap-metrics`; in the active overlay
    the router's worker URLs are the decode taps and shadow-mode requests reach the router through
    the front tap."""
    import json
    import os

    if overlay == "active":
        _needs_active()
    docs = _build(K8S / "overlays" / overlay)
    spec, side = _sidecar(docs)
    tap = _tap_container(spec)
    ports = {p["name"]: p["containerPort"] for c in (side, tap) for p in c["ports"]}
    token = "an-admin-token-of-32-characters!"

    def env_of(c: dict[str, Any]) -> dict[str, str]:  # tokens as the Secrets set them, paths under tmp
        return {e["name"]: str(tmp_path / e["value"].lstrip("/")) if "value" in e else token
                for e in c["env"]}

    shadow = find_executable("shadow")
    assert shadow, "the shadow console script is missing"
    for _ in range(5):  # a port of the run may be taken between the probe and the bind: try another
        base = _free_run(12)
        offset = base - ports["shadow-api"]
        moved = ("--host=", "--port=", "--metrics-port=")
        targs = [a for a in tap["args"] if not a.startswith(moved)] + [
            "--host=127.0.0.1", f"--port={9401 + offset}", f"--metrics-port={ports['tap-metrics'] + offset}"]
        proc = subprocess.Popen([shadow, *targs], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **env_of(tap)}, cwd=tmp_path)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.strip():
                continue
            tready = json.loads(line)
            sargs = [a.replace("/var/lib/shadow", str(tmp_path / "var/lib/shadow"))
                     for a in _local_argv(side["args"], docs, tmp_path)]
            ready = _listening(sargs, tmp_path, env_of(side), base=base)
        finally:
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        break
    else:
        raise AssertionError("no free port run for the tap")
    assert _port(ready["api"]) == ports["shadow-api"] + offset
    assert _port(tready["metrics"]) == ports["tap-metrics"] + offset
    assert ready["taps"] == tready["taps"]  # the analysis names the taps it attached to
    if overlay == "example":
        assert _port(ready["taps"]["router"]) == ports["shadow-front"] + offset
    else:
        (flag,) = [a for a in side["args"] if a.startswith("--active-port=")]
        assert int(flag.split("=")[1]) == ports["shadow-front"]  # clients reach the proxy
        assert _port(ready["active"]) == base + 7  # ... which listens where told
        # the front tap is internal (proxy -> front tap -> router), under its own name
        assert _port(ready["taps"]["router"]) == ports["tap-front"] + offset
        (router,) = [c for c in spec["containers"] if c["name"] == "router"]
        urls = router["args"][router["args"].index("--worker-urls") + 1:]
        taps = {_port(ready["taps"][n]) - offset for n in ("d0", "d1")}
        assert {_port(u) for u in urls} == taps and all("127.0.0.1" in u for u in urls)
