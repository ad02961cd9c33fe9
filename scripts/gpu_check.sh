#!/usr/bin/env bash
# The device check of issue 48: every part of scripts/gpu_check.py in turn, each in its own process under its own time
# budget (a crash or a hang costs that part alone), then OUTDIR/summary.json. On an H100 it all ends within 8 minutes.
# Usage: scripts/gpu_check.sh OUTDIR [--device cpu] [--quick] [--tests all|quick|none] [--compile-mode MODE]
# It writes OUTDIR/{env,curves,greedy,compiled,tests,summary}.json and OUTDIR/gpu_check.log: 7 files.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 OUTDIR [--device cpu] [--quick] [--tests all|quick|none] [--compile-mode MODE]" >&2
                 exit 2; }
mkdir -p "$1" && OUT=$(cd "$1" && pwd); shift  # (absolute: the script runs from the repository root)
cd "$(dirname "$0")/.."
LOG="$OUT/gpu_check.log"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PYTHON=${PYTHON:-python3}  # the interpreter that holds torch (on the device, plain python3)
START=$SECONDS
TOTAL=${GPU_CHECK_TOTAL:-470}  # seconds for the parts: 8 minutes less the wheels' install, the summary, slack
QUICK=0; for a in "$@"; do [ "$a" = --quick ] && QUICK=1; done

# The project's dependencies missing on the device, as wheels gathered by scripts/gather_wheels.sh; only those not
# installed (or installed older) go in, so the image's own torch stack is never shadowed.
if compgen -G ".whl/*.whl" >/dev/null; then
    WANTED=$("$PYTHON" - .whl/*.whl <<'EOF'
import importlib.metadata, sys
try:
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging.version import Version
for wheel in sys.argv[1:]:
    name, version = wheel.rsplit("/", 1)[-1].split("-")[:2]
    try:
        if Version(importlib.metadata.version(name)) >= Version(version):
            continue
    except importlib.metadata.PackageNotFoundError:
        pass
    print(wheel)
EOF
)
    if [ -n "$WANTED" ]; then
        echo "installing: $WANTED" >>"$LOG"
        INSTALL=("$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site)
        # one wheel the machine cannot take (a newer glibc) fails the lot: then each is tried alone
        # shellcheck disable=SC2086
        "${INSTALL[@]}" $WANTED >>"$LOG" 2>&1 || for wheel in $WANTED; do
            "${INSTALL[@]}" "$wheel" >>"$LOG" 2>&1 || echo "could not install $wheel" | tee -a "$LOG"
        done
    fi
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

RCS=()
run_part() {  # PART SECONDS [OPTIONS]: killed after SECONDS; it measures for SECONDS less its imports and model builds
    local part=$1 wall=$2 left=$((TOTAL - (SECONDS - START))); shift 2
    [ "$wall" -gt "$left" ] && wall=$left
    if [ "$wall" -lt 20 ]; then
        echo "$part: skipped, the total time budget is spent" | tee -a "$LOG"; RCS+=(--rc "$part=-1"); return
    fi
    echo "== $part (${wall} s) ==" >>"$LOG"
    timeout -k 5 "$wall" "$PYTHON" scripts/gpu_check.py "$part" "$OUT" --budget $((wall - 20)) "$@" >>"$LOG" 2>&1
    local rc=$?
    RCS+=(--rc "$part=$rc")
    echo "$part: exit $rc at $((SECONDS - START)) s" | tee -a "$LOG"
}
# seconds per part, full and --quick; GPU_CHECK_PARTS (e.g. "env greedy tests") runs some of them, in this order,
# PART:SECONDS giving one its own time (e.g. "compiled:400" for a slow compile mode)
declare -A WALL=([env]=30 [greedy]=60 [batch]=90 [profile]=30 [curves]=60 [compiled]=160)  # 430 s; the tests get
# the rest
[ $QUICK = 1 ] && WALL=([env]=30 [greedy]=60 [batch]=40 [profile]=40 [curves]=60 [compiled]=30)  # curves: a CPU without
# bfloat16 instructions (AVX2) costs bfloat16 calls by their tokens: ~19 s of quick curves on one thread, alone
for item in ${GPU_CHECK_PARTS:-env greedy batch profile curves compiled tests}; do
    part=${item%%:*}
    wall=${WALL[$part]:-$TOTAL}  # (the tests take what the parts before them left)
    [ "$item" != "$part" ] && wall=${item#*:}
    run_part "$part" "$wall" "$@"
done
"$PYTHON" scripts/gpu_check.py summary "$OUT" "${RCS[@]}" >>"$LOG" 2>&1
echo "total $((SECONDS - START)) s; results in $OUT/summary.json"
