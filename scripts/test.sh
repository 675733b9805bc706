#!/usr/bin/env bash
# Install shadow with its test extras and the system packages the tests need, then run the
# whole suite (unit, property, integration with real Prometheus / vllm-router / openai client,
# ruff and mypy). Run it inside the Python environment you want to use (a venv is best).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet --upgrade pip
# [ray]: tests/replay/test_sweep_ray.py runs `shadow sweep --ray` against a local Ray instance.
# constraints-test.txt: the exact versions the suite was last run with (refresh: scripts/lock.sh).
python3 -m pip install --quiet -c constraints-test.txt -e '.[test,ray]'
python3 -m pip check

# Debian packages: Prometheus, Alertmanager and systemd (systemd-analyze) for the observability and
# deploy tests; podman, mmdebstrap and runc build and run the container image (tests/deploy/test_image.py);
# etcd-server for the leader leases of active replicas (tests/active/test_leases.py starts its own).
packages="prometheus prometheus-alertmanager systemd podman mmdebstrap runc etcd-server"
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1 \
   || ! command -v prometheus-alertmanager >/dev/null 2>&1 || ! command -v systemd-analyze >/dev/null 2>&1 \
   || ! command -v podman >/dev/null 2>&1 || ! command -v mmdebstrap >/dev/null 2>&1 \
   || ! command -v runc >/dev/null 2>&1 || ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ]; then
    echo "installing $packages (Debian packages) for the tests..." >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $packages >/dev/null
  else
    echo "missing: run 'sudo apt-get install -y $packages' (tests that need them will fail)" >&2
  fi
fi
if ! command -v kubectl >/dev/null 2>&1; then
  echo "kubectl is missing: tests/deploy needs 'kubectl kustomize' (kubectl >= 1.27)" >&2
fi

# The real-engine tier (tests/realvllm, marker `vllm`): vLLM CPU in its own venv (.venv-vllm, ~3 GB,
# ~3 min the first time, seconds when it is already there). Its tests fail without it.
scripts/install-vllm.sh

# 3 workers (pytest-xdist; SHADOW_TEST_WORKERS=0 runs serially): most tests wait on processes and
# real time, so serially the 2 cores are idle half the time; how the suite is shared out, and which
# tests never run beside each other: tests/conftest.py. Arguments after it (`-n 0` too) win.
set +e
python3 -m pytest -n "${SHADOW_TEST_WORKERS:-3}" "$@"
rc=$?
set -e
if [ "$rc" = "5" ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"
