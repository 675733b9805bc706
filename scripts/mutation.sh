#!/usr/bin/env bash
# Mutation testing with mutmut: how many small code changes (flipped comparisons, off-by-one
# bounds, dropped terms, swapped constants...) the tests catch, per package, and which survive.
#
#   scripts/mutation.sh                 # core, engine and mirror (state + analyzer)
#   scripts/mutation.sh core engine     # a selection
#   scripts/mutation.sh --again core    # after adding tests: re-check only the mutants that were
#                                       # not killed in the last run (same scratch copy and sources)
#
# Needs the optional extra:  pip install -e '.[mutation]'
# Each package runs in its own scratch copy (build/mutation/<package>, the working tree as it is,
# committed or not) with only the tests relevant to it, so that a run stays well under 30
# minutes for core + engine on 2 cores. Hypothesis tests are capped at MUTATION_MAX_EXAMPLES
# examples there (default 30, scripts/mutation_conftest.py). Runs under `nice`; MUTATION_JOBS
# sets the parallel workers (default 2). Prints per package: killed / tested = kill rate, then every surviving
# mutant's name (see the diff with `cd build/mutation/<package> && mutmut show NAME`).
# Equivalent mutants (no behaviour change, cannot be killed) are listed in docs/mutation.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
JOBS=${MUTATION_JOBS:-2}
WORK=${MUTATION_DIR:-$ROOT/build/mutation}
if ! "$PY" -c "import mutmut" 2>/dev/null; then
  echo "mutation.sh: mutmut is not installed: pip install -e '.[mutation]'" >&2
  exit 2
fi

# package -> files to mutate (globs) | tests that exercise them
declare -A MUTATE=(
  [core]="shadow/core/*"
  [engine]="shadow/engine/*"
  [mirror]="shadow/mirror/state.py shadow/mirror/analyzer.py"
)
declare -A TESTS=(
  [core]="tests/core"
  [engine]="tests/engine"
  [mirror]="tests/mirror/test_state.py tests/mirror/test_analyzer.py"
)

AGAIN=0
if [ "${1:-}" = "--again" ]; then
  AGAIN=1
  shift
fi
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(core engine mirror)
for t in "${targets[@]}"; do
  if [ -z "${MUTATE[$t]:-}" ]; then
    echo "mutation.sh: unknown package '$t' (choose from: ${!MUTATE[*]})" >&2
    exit 2
  fi
done

toml_list() {  # words -> TOML list of strings
  local out="" w
  for w in "$@"; do out+="\"$w\", "; done
  echo "[${out%, }]"
}

summary=()
for t in "${targets[@]}"; do
  dir=$WORK/$t
  start=$(date +%s)
  if [ "$AGAIN" = 1 ]; then
    if [ ! -d "$dir/mutants" ]; then
      echo "mutation.sh: no previous run of $t in $dir: run without --again first" >&2
      exit 2
    fi
    rm -rf "$dir/tests"
    cp -r tests "$dir/"
    find "$dir/tests" -name __pycache__ -prune -exec rm -rf {} +
    (cd "$dir" && "$PY" -m mutmut results --all true >"$dir/results.txt")
    mapfile -t again < <(grep -v ": killed$" "$dir/results.txt" | grep -v ": timeout$" | sed 's/^ *//; s/: [^:]*$//')
    echo "== $t: re-checking ${#again[@]} mutants not killed in the last run" >&2
    if [ ${#again[@]} -gt 0 ]; then
      (cd "$dir" && nice -n 10 "$PY" -m mutmut run --max-children "$JOBS" "${again[@]}" >"$dir/run-again.log" 2>&1) || {
        echo "mutation.sh: mutmut failed for $t, see $dir/run-again.log" >&2
        tail -20 "$dir/run-again.log" >&2
        exit 1
      }
    fi
  else
  rm -rf "$dir"
  mkdir -p "$dir"
  cp -r shadow tests pyproject.toml "$dir/"
  cp scripts/mutation_conftest.py "$dir/conftest.py"
  find "$dir" -name __pycache__ -prune -exec rm -rf {} +
  # shellcheck disable=SC2086
  cat >> "$dir/pyproject.toml" <<TOML

[tool.mutmut]
source_paths = ["shadow"]
only_mutate = $(toml_list ${MUTATE[$t]})
pytest_add_cli_args_test_selection = $(toml_list ${TESTS[$t]})
pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-x"]
use_git_change_detection = false
also_copy = ["conftest.py"]
TOML
  echo "== $t: mutating ${MUTATE[$t]} against ${TESTS[$t]}" >&2
  (cd "$dir" && nice -n 10 "$PY" -m mutmut run --max-children "$JOBS" >"$dir/run.log" 2>&1) || {
    echo "mutation.sh: mutmut failed for $t, see $dir/run.log" >&2
    tail -20 "$dir/run.log" >&2
    exit 1
  }
  fi
  secs=$(( $(date +%s) - start ))
  (cd "$dir" && "$PY" -m mutmut results --all true >"$dir/results.txt")
  line=$("$PY" - "$t" "$secs" "$dir/results.txt" "$AGAIN" <<'PYEOF'
import collections
import sys

name, secs, path, again = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
status = {}
for raw in open(path, encoding="utf-8"):
    key, sep, st = raw.strip().rpartition(": ")
    if sep:
        status[key] = st
counts = collections.Counter(status.values())
killed = counts["killed"] + counts["timeout"] + counts["caught by type check"]
tested = len(status) - counts["skipped"]
rate = 100.0 * killed / tested if tested else 0.0
others = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("killed",))
print(f"{name}: {killed}/{tested} mutants killed = {rate:.1f}% ({others or 'none other'}; {secs} s{' re-checking survivors' if again else ''})")
survivors = sorted(k for k, v in status.items() if v not in ("killed", "timeout", "caught by type check", "skipped"))
for k in survivors:
    print(f"    {status[k]:>10}  {k}")
PYEOF
)
  echo "$line"
  summary+=("$(echo "$line" | head -1)")
done
echo
echo "mutation kill rates ($(date -u +%Y-%m-%d), mutmut $("$PY" -c 'import importlib.metadata as m; print(m.version("mutmut"))')):"
for s in "${summary[@]}"; do echo "  $s"; done
