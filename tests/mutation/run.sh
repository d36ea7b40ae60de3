#!/usr/bin/env bash
# Mutation testing of the scheduler and the ledger with mutmut (a development tool: not part of `make test`;
# install it with `.venv/bin/pip install mutmut`). The two modules and the fast tests that cover them
# (tests/test_scheduler.py) are copied into a scratch directory, so the working tree is never mutated, and
# mutmut runs there (about 5 minutes on two cores). Prints mutmut's list of surviving mutants and the score;
# docs/testing.md records the last score and why each survivor is equivalent.
#
#   tests/mutation/run.sh                  # the scratch directory is removed at the end
#   WORK=/tmp/mut tests/mutation/run.sh    # kept there: cd /tmp/mut && mutmut show NAME gives a mutant's diff
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
mutmut=${MUTMUT:-$repo/.venv/bin/mutmut}
python=${PYTHON:-$repo/.venv/bin/python}
work=${WORK:-$(mktemp -d -t dora-jax-mutation-XXXXXX)}
if [ -z "${WORK:-}" ]; then
  trap 'rm -rf "$work"' EXIT
fi

mkdir -p "$work/dora_jax/dora" "$work/tests"
cp "$repo/dora_jax/__init__.py" "$work/dora_jax/"
cp "$repo/dora_jax/dora/__init__.py" "$repo/dora_jax/dora/ledger.py" "$repo/dora_jax/dora/scheduler.py" \
  "$work/dora_jax/dora/"
cp "$repo/tests/test_scheduler.py" "$repo/tests/invariants.py" "$work/tests/"
cat > "$work/setup.cfg" <<'CFG'
[mutmut]
source_paths=dora_jax/dora/
pytest_add_cli_args_test_selection=tests/test_scheduler.py
use_git_change_detection=false
CFG

cd "$work"
echo "mutating dora_jax/dora/{ledger,scheduler}.py in $work"
"$mutmut" run >"$work/run.log" 2>&1 || { tail -40 "$work/run.log"; exit 1; }
"$mutmut" export-cicd-stats >/dev/null
"$mutmut" results || true
"$python" - <<'PY'
import json
s = json.load(open("mutants/mutmut-cicd-stats.json"))
total = sum(s[k] for k in ("killed", "survived", "timeout", "suspicious", "no_tests", "skipped", "segfault",
                           "check_was_interrupted_by_user") if k in s)
print(json.dumps(s))
print(f"mutation score: {100 * (s['killed'] + s.get('timeout', 0)) / max(total, 1):.1f}% "
      f"({s['killed']} killed, {s.get('timeout', 0)} timed out, {s['survived']} survived, "
      f"{s.get('no_tests', 0)} not covered, of {total})")
PY
