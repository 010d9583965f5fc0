#!/usr/bin/env bash
# Runs the README's first test and its gate flow N times, each in a fresh folder, and counts the gate's exit statuses.
# The README promises exit status 1 (the `loss` rule fails the session) on every run: anything else is a failure.
#
#   tools/readme_flow_check.sh [N]        # N runs (default 10); PYTHON=... picks the interpreter (default .venv's)
#
# The test file and both commands are read from README.md itself, so this checks what a reader copies. Prints one
# line per run (the save run's and the gate's exit statuses, and the gate's table row), then the counts; exits 0
# only when every gate run exited 1.
set -u
runs=${1:-10}
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The python block of "## A first test", and the two commands of the bash block holding --kernel-ab-save.
"$python" - "$root/README.md" "$work" <<'EOF' || exit 2
import pathlib, re, sys
readme, work = pathlib.Path(sys.argv[1]).read_text(), pathlib.Path(sys.argv[2])
section = readme.split("## A first test", 1)[1]
test = re.search(r"```python\n(.*?)```", section, re.S).group(1)
commands = next(block for block in re.findall(r"```bash\n(.*?)```", section, re.S) if "--kernel-ab-save" in block)
save, gate = [line for line in commands.splitlines() if line.strip()]
(work / "test_first.py").write_text(test)
(work / "save.sh").write_text(save.replace(".venv/bin/python", '"$PYTHON"') + "\n")
(work / "gate.sh").write_text(gate.replace(".venv/bin/python", '"$PYTHON"') + "\n")
EOF
echo "save: $(cat "$work/save.sh")"
echo "gate: $(cat "$work/gate.sh")"

declare -A counts=()
for i in $(seq 1 "$runs"); do
    run="$work/run$i"
    mkdir -p "$run" && cp "$work/test_first.py" "$run/"
    # The checkout's plugin, whatever the interpreter has installed; no ini of this repository.
    (cd "$run" && PYTHON="$python" PYTHONPATH="$root" bash "$work/save.sh" > save.log 2>&1)
    saved=$?
    (cd "$run" && PYTHON="$python" PYTHONPATH="$root" bash "$work/gate.sh" > gate.log 2>&1)
    status=$?
    counts[$status]=$(( ${counts[$status]:-0} + 1 ))
    row=$(grep -m1 "^test_softmax_is_faster" "$run/gate.log" | tr -s ' ')
    echo "run $i: save exit $saved, gate exit $status: $row"
done
echo "gate exit statuses over $runs runs:"
for status in "${!counts[@]}"; do echo "  exit $status: ${counts[$status]}"; done
[ "${counts[1]:-0}" -eq "$runs" ]
