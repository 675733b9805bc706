#!/usr/bin/env bash
# Mutation testing with mutmut: how many small code changes (flipped comparisons, off-by-one
# bounds, dropped terms, swapped constants...) the tests catch, per package, and which survive.
#
#   scripts/mutation.sh                 # core, engine and mirror (state + analyzer)
#   scripts/mutation.sh core engine     # a selection
#   scripts/mutation.sh --again core    # after adding tests: re-check only the mutants that were
#                                       # not killed in the last run (same scratch copy and sources)
#   scripts/mutation.sh --parallel core engine
#                                       # the packages at the same time (MUTATION_JOBS workers each):
#                                       # one's serial phases overlap the other's mutant runs
#   MUTATION_ONLY='shadow.engine.offline.x_run_lane*' scripts/mutation.sh engine
#                                       # only the mutants whose names match these globs (space-
#                                       # separated), from a fresh copy; the report counts only them
#
# Needs the optional extra:  pip install -e '.[mutation]'
# Each package runs in its own scratch copy (build/mutation/<package>, the working tree as it is,
# committed or not). What keeps it fast (docs/mutation.md):
#   - only the package's own fast tests are selected (TESTS below; `-m "not integration"`), and
#     mutmut maps each mutated function to the tests that call it and runs only those, fastest
#     first, stopping at the first failure;
#   - Hypothesis runs the `mutation` profile (tests/conftest.py): at most MUTATION_MAX_EXAMPLES
#     examples per property test (default 30), derandomized, no example database;
#   - hanging mutants are stopped after MUTATION_TIMEOUT_MULTIPLIER (default 15, mutmut's) x
#     (their tests' measured time + 1 s) of wall time;
#   - MUTATION_JOBS parallel workers (default: the number of cores), under `nice -n MUTATION_NICE`
#     (default 15) so other work on the machine keeps its share.
# Prints per package: killed / tested = kill rate, the wall time, the CPU seconds used (user + sys,
# independent of machine load) and the load average, then every surviving mutant's name (see the
# diff with `cd build/mutation/<package> && mutmut show NAME`; reports also kept in
# build/mutation/<package>.report), and at the end the total wall time and CPU seconds.
# Equivalent mutants (no behaviour change, cannot be killed) are listed in docs/mutation.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
JOBS=${MUTATION_JOBS:-$(nproc 2>/dev/null || echo 2)}
NICE=${MUTATION_NICE:-15}
WORK=${MUTATION_DIR:-$ROOT/build/mutation}
# a mutant is stopped (a timeout, counted as killed) after TIMEOUT x (its tests' measured time + 1 s)
# of wall time, or twice that in CPU time. Keep mutmut's 15: the wall-clock limit cannot tell a
# hanging mutant from a slow run on a loaded machine (5 timed correct runs out under load 12).
# Hanging mutants are made cheap by the tests instead: bounded loops that fail fast (docs/mutation.md).
TIMEOUT=${MUTATION_TIMEOUT_MULTIPLIER:-15}
export SHADOW_HYPOTHESIS_PROFILE=mutation
export SHADOW_MUTATION_MAX_EXAMPLES=${MUTATION_MAX_EXAMPLES:-30}
if ! "$PY" -c "import mutmut" 2>/dev/null; then
  echo "mutation.sh: mutmut is not installed: pip install -e '.[mutation]'" >&2
  exit 2
fi

# package -> files to mutate (globs) | the fast tests that exercise them
declare -A MUTATE=(
  [core]="shadow/core/*"
  [engine]="shadow/engine/*"
  [mirror]="shadow/mirror/state.py shadow/mirror/analyzer.py"
)
declare -A TESTS=(
  [core]="tests/core"
  [engine]="tests/engine tests/live/test_live_driver.py tests/replay/test_protocol.py"
  [mirror]="tests/mirror/test_state.py tests/mirror/test_analyzer.py"
)
# slow tests left out of a package's selection because faster selected tests cover the same
# functions (docs/mutation.md says which and why)
declare -A DESELECT=(
  [engine]="tests/live/test_live_driver.py::test_br0_beats_a_jsq_bytes_router_on_a_saturated_paper_like_run"
)

read -r -a ONLY <<<"${MUTATION_ONLY:-}"
AGAIN=0
PARALLEL=0
while [ $# -gt 0 ]; do
  case "$1" in
    --again) AGAIN=1; shift ;;
    --parallel) PARALLEL=1; shift ;;
    *) break ;;
  esac
done
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

loadavg() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?"; }

# one package: fresh scratch copy (or --again), mutmut run, report -> $WORK/<package>/report.txt
run_one() {
  local t=$1 dir load_start load_end log rc
  local -a mutants deselect
  dir=$WORK/$t
  load_start=$(loadavg)
  if [ "$AGAIN" = 1 ]; then
    if [ ! -d "$dir/mutants" ]; then
      echo "mutation.sh: no previous run of $t in $dir: run without --again first" >&2
      return 2
    fi
    rm -rf "$dir/tests"
    cp -r tests "$dir/"
    find "$dir/tests" -name __pycache__ -prune -exec rm -rf {} +
    (cd "$dir" && "$PY" -m mutmut results --all true >"$dir/results.txt")
    mapfile -t mutants < <(grep -v ": killed$" "$dir/results.txt" | grep -v ": timeout$" | sed 's/^ *//; s/: [^:]*$//')
    echo "== $t: re-checking ${#mutants[@]} mutants not killed in the last run" >&2
    log=$dir/run-again.log
  else
    rm -rf "$dir"
    mkdir -p "$dir"
    cp -r shadow tests pyproject.toml "$dir/"
    find "$dir" -name __pycache__ -prune -exec rm -rf {} +
    deselect=()
    for d in ${DESELECT[$t]:-}; do deselect+=(--deselect "$d"); done
    # shellcheck disable=SC2086
    cat >> "$dir/pyproject.toml" <<TOML

[tool.mutmut]
source_paths = ["shadow"]
only_mutate = $(toml_list ${MUTATE[$t]})
pytest_add_cli_args_test_selection = $(toml_list ${TESTS[$t]} "${deselect[@]}")
pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-x", "-m", "not integration"]
use_git_change_detection = false
timeout_multiplier = $TIMEOUT
TOML
    mutants=("${ONLY[@]}")
    echo "== $t: mutating ${MUTATE[$t]} against ${TESTS[$t]} ($JOBS workers, nice $NICE)" >&2
    log=$dir/run.log
  fi
  rc=0
  if [ "$AGAIN" = 0 ] || [ ${#mutants[@]} -gt 0 ]; then
    # bash's `time` counts the CPU of every reaped descendant (mutmut's forked workers included)
    TIMEFORMAT="%R %U %S"
    { time (cd "$dir" && nice -n "$NICE" "$PY" -m mutmut run --max-children "$JOBS" "${mutants[@]}" \
        >"$log" 2>&1) || rc=$?; } 2>"$dir/time.txt"
  else
    echo "0 0 0" >"$dir/time.txt"
  fi
  if [ "$rc" != 0 ]; then
    echo "mutation.sh: mutmut failed for $t, see $log" >&2
    tail -20 "$log" >&2
    return 1
  fi
  load_end=$(loadavg)
  (cd "$dir" && "$PY" -m mutmut results --all true >"$dir/results.txt")
  "$PY" - "$t" "$dir/time.txt" "$dir/results.txt" "$AGAIN" "$JOBS" "$load_start" "$load_end" "${ONLY[@]}" <<'PYEOF'
import collections
import fnmatch
import sys

name, timing, path, again, jobs, load0, load1 = sys.argv[1:8]
only = sys.argv[8:]
wall, user, sys_ = (float(x) for x in open(timing, encoding="utf-8").read().split()[-3:])
cpu = user + sys_
status = {}
for raw in open(path, encoding="utf-8"):
    key, sep, st = raw.strip().rpartition(": ")
    if sep and (not only or any(fnmatch.fnmatch(key, p) for p in only)):
        status[key] = st
counts = collections.Counter(status.values())
killed = counts["killed"] + counts["timeout"] + counts["caught by type check"]
tested = len(status) - counts["skipped"]
rate = 100.0 * killed / tested if tested else 0.0
others = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("killed",))
what = " re-checking survivors" if again == "1" else ""
what += f" (only {' '.join(only)})" if only else ""
print(
    f"{name}: {killed}/{tested} mutants killed = {rate:.1f}% ({others or 'none other'}); "
    f"{wall:.0f} s wall{what}, {cpu:.0f} CPU-s ({jobs} workers; load {load0} -> {load1})"
)
survivors = sorted(k for k, v in status.items() if v not in ("killed", "timeout", "caught by type check", "skipped"))
for k in survivors:
    print(f"    {status[k]:>10}  {k}")
PYEOF
}

mkdir -p "$WORK"
t0=$(date +%s.%N)
rc_all=0
if [ "$PARALLEL" = 1 ]; then
  # packages at the same time (each with MUTATION_JOBS workers): one package's serial phases
  # (stats run, clean run, bookkeeping) overlap the other's parallel mutant runs
  pids=()
  for t in "${targets[@]}"; do
    run_one "$t" >"$WORK/$t.report" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc_all=1; done
else
  for t in "${targets[@]}"; do
    run_one "$t" >"$WORK/$t.report" || { rc_all=1; break; }
    cat "$WORK/$t.report"
  done
fi
wall=$(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN { printf "%.0f", a - b }')
[ "$PARALLEL" = 0 ] || for t in "${targets[@]}"; do cat "$WORK/$t.report" 2>/dev/null; done
[ "$rc_all" = 0 ] || exit 1
echo
echo "mutation kill rates ($(date -u '+%Y-%m-%d %H:%M UTC'), mutmut $("$PY" -c 'import importlib.metadata as m; print(m.version("mutmut"))')$([ "$PARALLEL" = 1 ] && echo ", packages in parallel")):"
cpu_total=0
for t in "${targets[@]}"; do
  head -1 "$WORK/$t.report" | sed 's/^/  /'
  cpu=$(head -1 "$WORK/$t.report" | sed -n 's/.* \([0-9][0-9]*\) CPU-s .*/\1/p')
  cpu_total=$((cpu_total + ${cpu:-0}))
done
echo "  total: $wall s wall, $cpu_total CPU-s; load average now $(loadavg)"
