#!/usr/bin/env bash
# tiermem on a GPU in one command: build, GPU tests, side-by-side benchmark at two sizes.
#
#   benchmarks/gpu_suite.sh OUTDIR
#   benchmarks/gpu_suite.sh --dry-run     (prints the time plan below, runs nothing)
#
# Needs: python3 with a CUDA build of torch, nvcc, ninja, pytest, psutil, numpy
# (matplotlib optional: without it the PNGs are skipped and can be drawn later
# with benchmarks/plots.py). No network. Runs from a source checkout; tiermem
# need not be installed (the checkout goes on PYTHONPATH).
#
# Parts, each with its own time limit inside an overall budget
# (TIERMEM_SUITE_SECONDS, default 540 s, so that it ends under 10 minutes, a lent
# GPU machine's limit per command, with its start inside a 15-minute lease); a failing or
# timed-out part is reported and the others still run:
#   env       nvidia-smi, torch/CUDA versions, RAM, disks (log only)
#   wheels    if .whl/ holds wheels (e.g. torchtune, torchao, deepspeed carried
#             to a machine without network): installed with pip --target
#   build     python -m tiermem build (the C++ I/O engine, with its CUDA chain when
#             CUDA_HOME has nvcc; prints which)
#   gpu-tests python -m pytest -m gpu tests/, but for the ranks' files (right
#             after the build: see PLAN)
#   doctor    python -m tiermem doctor
#   size-a    python -m benchmarks.suite --preset gpu-a: the baseline fits, activations dominate
#   host-cost benchmarks/bench_host_cost.py --device cuda: the forward's host time
#             under tracking against torch SAC (docs/host-cost.md's model, checked)
#   host-prof bench_host_cost.py --profile: cProfile of recompute and of SAC (width 256)
#   size-b    python -m benchmarks.suite --preset gpu-b: a 24 GiB budget the baseline does not fit
#   gpu-ranks the gpu tests that spawn NCCL ranks (tests/test_fsdp.py,
#             tests/test_planner_ranks.py), with what time is left
# Without CUDA it dry-runs: the CUDA parts are skipped (said so in SUMMARY.md)
# and the CPU smoke matrix (--preset cpu-smoke) runs instead.
#
# OUTDIR gets at most 8 plain files (no subfolders):
#   SUMMARY.md    each part's status, duration and limit; the result tables;
#                 the last lines of the log of each part that did not pass
#   logs.tar.gz   every log, the Markdown tables, the partial JSON of stopped runs
#   size-a.json size-a-pareto.png size-a-timeline.png   (and the same for size-b;
#   or cpu-smoke.* on a CPU-only machine)
#
# Environment: TIERMEM_BENCH_COMMIT (the commit the results files record: the
# device's copy of the tree keeps the session's first HEAD; pass the real one),
# PYTHON (default python3), TIERMEM_SUITE_SECONDS (540),
# TIERMEM_SUITE_PARTS (default: all; e.g. "env build host-cost host-prof"),
# TIERMEM_BENCH_NVME_DIR (default: a new dir under /var/tmp or /tmp, whichever
# is not tmpfs), TIERMEM_BENCH_CPU_BUDGET (tiermem cpu_budget for the runs;
# default half of MemTotal), TORCH_EXTENSIONS_DIR (default
# /tmp/tiermem-torch-extensions, reused by later runs on the same machine).

set -u -o pipefail

START=$(date +%s)
LIMIT=${TIERMEM_SUITE_SECONDS:-540}

# The time plan: part, cap (s), reserve kept for the parts after it (s), in
# the order they run, which is the order of priority: the single-process GPU
# tests right after the build, so that a run cut short still gives their
# verdict; then the benchmark rows; the tests that spawn NCCL ranks (a
# module fixture of up to 240 s that the per-test timeout does not cover)
# last, with what is left. Caps are estimates, not measurements (the cold
# build took 112-128 s on 2 cores against torch 2.11+cu130; the GPU machine
# has 16): time each part on the first real GPU run and write the figures
# here. The caps add up to more than the budget: in the worst case the later
# parts get less or are skipped (``--dry-run`` shows it), never the earlier.
PLAN="env 20 510
wheels 60 450
build 150 360
gpu-tests 120 240
doctor 30 210
size-a 200 0
host-cost 75 0
host-prof 30 0
size-b 110 0
gpu-ranks 90 0"
# TIERMEM_SUITE_PARTS (default: every part): the parts to run, by name,
# separated by spaces or commas; the others are recorded as skipped. A part's
# reserve is then at most the caps of the selected parts after it, and at most
# what the budget leaves after the caps of the selected parts up to it, so that
# a short run of a few parts is not starved by reserves for parts it skips, and
# the earlier parts keep their caps when the later ones cannot all fit.
PARTS=$(echo "${TIERMEM_SUITE_PARTS:-}" | tr ',' ' ')
selected() { [ -z "$PARTS" ] || [[ " $PARTS " == *" $1 "* ]]; }
for p in $PARTS; do
    if ! echo "$PLAN" | awk -v n="$p" '$1 == n {f = 1} END {exit !f}'; then
        echo "gpu_suite: TIERMEM_SUITE_PARTS names '$p', which is no part of the suite" \
             "(parts: $(echo "$PLAN" | awk '{printf "%s ", $1}'))" >&2
        exit 2
    fi
done
if [ -n "$PARTS" ]; then
    PLAN=$(through=0; echo "$PLAN" | while read -r name cap reserve; do
        selected "$name" || { echo "$name 0 0"; continue; }
        through=$(( through + cap ))
        later=$(echo "$PLAN" | awk -v n="$name" 'f {print $1, $2} $1 == n {f = 1}' \
            | while read -r m c; do selected "$m" && echo "$c"; done | awk '{s += $1} END {print s + 0}')
        left=$(( LIMIT - through > 0 ? LIMIT - through : 0 ))
        [ "$later" -lt "$reserve" ] && reserve=$later
        [ "$left" -lt "$reserve" ] && reserve=$left
        echo "$name $cap $reserve"
    done)
fi
plan_of() { echo "$PLAN" | awk -v n="$1" '$1 == n {print $2, $3}'; }

if [ "${1:-}" = "--dry-run" ]; then
    # The plan only: each part's window in the worst case (every part before
    # it using its whole limit). Nothing is run.
    echo "gpu_suite plan for a ${LIMIT}s budget (TIERMEM_SUITE_SECONDS)"
    printf '%-10s %6s %8s %10s %10s\n' part cap reserve starts-by limit
    t=0
    echo "$PLAN" | while read -r name cap reserve; do
        if ! selected "$name"; then
            printf '%-10s %6s %8s %10s %10s\n' "$name" - - - 0
            continue
        fi
        left=$(( LIMIT - t - reserve ))
        lim=$(( cap < left ? cap : left ))
        [ "$lim" -lt 0 ] && lim=0
        printf '%-10s %6s %8s %10s %10s\n' "$name" "$cap" "$reserve" "$t" "$lim"
        t=$(( t + lim ))
    done
    exit 0
fi
if [ $# -ne 1 ] || [ -z "$1" ]; then
    echo "usage: $0 OUTDIR | --dry-run" >&2
    exit 2
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$1" || { echo "gpu_suite: cannot create $1" >&2; exit 2; }
OUT=$(cd "$1" && pwd)
PY=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/tiermem-gpu-suite.XXXXXX)
LOGS=$WORK/logs
RES=$WORK/results
mkdir -p "$LOGS" "$RES"
STATUS=$WORK/status.tsv
: >"$STATUS"

cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tiermem-torch-extensions}
export TIERMEM_LOG=${TIERMEM_LOG:-info}

say() { echo "[gpu_suite $(( $(date +%s) - START ))s] $*" >&2; }
remaining() { echo $(( LIMIT - ($(date +%s) - START) )); }

# run_part NAME CAP RESERVE CMD...: run CMD with a limit of min(CAP, time left
# - RESERVE) seconds (RESERVE: kept for the parts after it), log to
# $LOGS/NAME.log, record status and duration. Sets PART_LIMIT for the command
# line (the benchmark driver gets a slightly shorter --time-limit of its own).
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >>"$STATUS"; }
run_part() {
    local name=$1 cap=$2 reserve=$3; shift 3
    if ! selected "$name"; then
        say "$name: skipped: not in TIERMEM_SUITE_PARTS"
        record "$name" "skipped" "not in TIERMEM_SUITE_PARTS" 0 0
        return 0
    fi
    local left=$(( $(remaining) - reserve ))
    local lim=$(( cap < left ? cap : left ))
    if [ "$lim" -lt 20 ]; then
        say "$name: skipped, no time left (${left}s after the reserve for later parts)"
        record "$name" "skipped" "no time left in the ${LIMIT}s budget" 0 "$lim"
        return 0
    fi
    say "$name: running (limit ${lim}s) -> logs/$name.log"
    local t0=$(date +%s)
    # Through bash -c so that exported shell functions run too; timeout signals
    # the whole process group (the driver's children included).
    timeout -k 10 "$lim" bash -c '"$@"' _ "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    local dt=$(( $(date +%s) - t0 ))
    local st
    case $rc in
        0) st=ok ;;
        124|137) st=TIMEOUT ;;
        *) st=FAILED ;;
    esac
    say "$name: $st (exit $rc, ${dt}s)"
    record "$name" "$st" "exit $rc" "$dt" "$lim"
    return 0
}
skip_part() { say "$1: skipped: $2"; record "$1" "skipped" "$2" 0 0; }

# --- where things are ----------------------------------------------------------
pick_nvme_dir() {
    if [ -n "${TIERMEM_BENCH_NVME_DIR:-}" ]; then
        mkdir -p "$TIERMEM_BENCH_NVME_DIR" && mktemp -d "$TIERMEM_BENCH_NVME_DIR/tiermem-bench.XXXXXX"
        return
    fi
    for d in /var/tmp /tmp "${HOME:-/root}"; do
        [ -d "$d" ] && [ -w "$d" ] || continue
        if [ "$(stat -f -c %T "$d" 2>/dev/null)" != "tmpfs" ]; then
            mktemp -d "$d/tiermem-bench.XXXXXX"
            return
        fi
    done
    mktemp -d /tmp/tiermem-bench.XXXXXX
}
NVME=$(pick_nvme_dir)
if [ -n "${TIERMEM_BENCH_CPU_BUDGET:-}" ]; then
    CPU_BUDGET=$TIERMEM_BENCH_CPU_BUDGET
else
    CPU_BUDGET="$(awk '/^MemTotal:/ {printf "%.0f", $2 * 1024 / 2}' /proc/meminfo 2>/dev/null)"
    [ -n "$CPU_BUDGET" ] || CPU_BUDGET=""
fi
cleanup() { rm -rf "$NVME"; }
trap cleanup EXIT

say "repo $ROOT, out $OUT, work $WORK, nvme dir $NVME, python $PY, budget ${LIMIT}s"

# --- env ------------------------------------------------------------------------
env_report() {
    echo "== date"; date -u +%FT%TZ
    echo "== git"; git -C "$ROOT" rev-parse HEAD 2>&1; git -C "$ROOT" status --short 2>&1 | head -50
    echo "== nvidia-smi"; nvidia-smi 2>&1 || echo "(no nvidia-smi)"
    nvidia-smi -q -d PCIE,CLOCK 2>/dev/null | head -60
    echo "== nvcc"; (command -v nvcc && nvcc --version) 2>&1 || echo "(no nvcc on PATH)"
    echo "== python"; "$PY" - <<'EOF'
import sys, platform
print(sys.version)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available",
          torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print("device", p.name, p.total_memory, f"cc {p.major}.{p.minor}")
except Exception as e:
    print("torch import failed:", e)
for m in ("numpy", "psutil", "pytest", "ninja", "matplotlib", "tqdm", "transformers",
          "torchtune", "torchao", "deepspeed"):
    try:
        mod = __import__(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "NOT importable:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
EOF
    echo "== memory"; free -g 2>&1; grep -E 'MemTotal|MemAvailable|Hugepagesize' /proc/meminfo
    echo "== disks"; df -hT "$NVME" /tmp /var/tmp 2>&1; lsblk 2>&1 | head -30
    echo "== cpu"; nproc; grep -m1 'model name' /proc/cpuinfo
}
export -f env_report
export PY ROOT NVME OUT RES LOGS
run_part env $(plan_of env) env_report

if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    HAVE_CUDA=1
else
    HAVE_CUDA=0
    say "no CUDA device (torch.cuda.is_available() is False or torch missing): dry run"
fi

# --- carried wheels (optional) ----------------------------------------------------
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    install_wheels() {
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/tiermem-site "$ROOT"/.whl/*.whl
    }
    export -f install_wheels
    run_part wheels $(plan_of wheels) install_wheels
    export PYTHONPATH="$PYTHONPATH:/tmp/tiermem-site"
else
    skip_part wheels "no .whl/ folder (peers such as torchtune/deepspeed run only if importable)"
fi

# --- build ---------------------------------------------------------------------------
# With a CUDA build of torch the engine is built with its CUDA chain
# (csrc/cuda_chain.cpp, csrc/cuda_bindings.cpp); that needs the toolkit (nvcc)
# under CUDA_HOME.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDA_HOME=/usr/local/cuda
fi
build_engine() {
    echo "CUDA_HOME=${CUDA_HOME:-unset}; TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-unset}"
    "$PY" -m tiermem build
}
export -f build_engine
run_part build $(plan_of build) build_engine

# --- GPU tests -------------------------------------------------------------------------
RANK_TESTS="tests/test_fsdp.py tests/test_planner_ranks.py"
gpu_tests() {  # gpu_tests NAME PYTEST-ARGS...
    local rc name=$1
    shift
    if [ "$HAVE_CUDA" = 1 ]; then
        # -v: a line per test as it ends (a run killed by its cap keeps
        # them); -rfE: the reason of each failure and error; junit XML for
        # the details; the slowest tests listed; TIERMEM_TEST_TIMEOUT_S: a
        # test running longer fails (tests/conftest.py) and the rest run.
        TIERMEM_TEST_TIMEOUT_S=${TIERMEM_TEST_TIMEOUT_S:-60} "$PY" -m pytest -m gpu -v -rfE \
            --durations=15 --junitxml="$LOGS/$name.xml" -p no:cacheprovider "$@"
        return
    fi
    echo "note: no CUDA device: every gpu test is expected to be skipped"
    "$PY" -m pytest -m gpu -q -p no:cacheprovider "$@"
    rc=$?
    # pytest exits 5 when no test ran, which is the expected outcome here.
    if [ "$rc" = 5 ]; then echo "dry run: no gpu test ran (exit 5), as expected"; return 0; fi
    return "$rc"
}
export HAVE_CUDA
export -f gpu_tests
ignore=()
for f in $RANK_TESTS; do ignore+=(--ignore="$f"); done
run_part gpu-tests $(plan_of gpu-tests) gpu_tests gpu-tests "${ignore[@]}" tests/
# What tiermem sees here (engine, O_DIRECT and bandwidth of the NVMe dir, RAM, GPU).
run_part doctor $(plan_of doctor) "$PY" -m tiermem doctor --dir "$NVME"

# --- benchmarks ------------------------------------------------------------------------
bench() {  # bench PRESET NAME
    local extra=()
    [ -n "$CPU_BUDGET" ] && extra+=(--tiermem-cpu-budget "$CPU_BUDGET")
    "$PY" -m benchmarks.suite --preset "$1" --name "$2" --out-dir "$RES" \
        --nvme-dir "$NVME" --progress plain --time-limit "$BENCH_LIMIT" --no-build \
        ${extra[@]+"${extra[@]}"}
}
bench_part() {  # bench_part NAME PRESET CAP RESERVE
    selected "$1" || { run_part "$1" "$3" "$4" true; return 0; }
    local left=$(( $(remaining) - $4 ))
    export BENCH_LIMIT=$(( ($3 < left ? $3 : left) - 20 ))
    if [ "$BENCH_LIMIT" -lt 30 ]; then   # the probe alone needs most of that
        say "$1: skipped, no time left (${BENCH_LIMIT}s for the benchmark)"
        record "$1" "skipped" "no time left in the ${LIMIT}s budget" 0 "$BENCH_LIMIT"
        return 0
    fi
    run_part "$1" "$3" "$4" bench "$2" "$1"
    # A run stopped by its limit leaves a partial JSON: render what it has.
    if [ -f "$RES/$1.json" ] && [ ! -f "$RES/$1.md" ]; then
        "$PY" -m benchmarks.suite --rerender "$RES/$1.json" >>"$LOGS/$1.log" 2>&1 \
            && say "$1: rendered the partial result"
    fi
}
export CPU_BUDGET
export -f bench
# Where the forward's host time goes on this host: cProfile of tiermem's
# recompute and of torch SAC at the host-bound width (docs/host-cost.md).
host_profiles() {
    local c
    for c in recompute sac_all_save; do
        "$PY" benchmarks/bench_host_cost.py --device cuda --widths 256 --layers 4 \
            --seq-len 512 --batch 4 --rounds 5 --warmup 2 --profile "$c" \
            --out "$RES/host-profile-$c.json" || return 1
    done
}
export -f host_profiles
if [ "$HAVE_CUDA" = 1 ]; then
    bench_part size-a gpu-a $(plan_of size-a)
    # Widths from host-bound (256) to device-bound (4096): both sides of
    # docs/host-cost.md's model.
    run_part host-cost $(plan_of host-cost) "$PY" benchmarks/bench_host_cost.py --device cuda \
        --widths 256,1024,4096 --layers 4 --seq-len 512 --batch 4 --rounds 8 --warmup 2 \
        --configs plain,sac_all_save,hooks_floor,keep,recompute,recompute_learning,recompute_nocheck,auto_scoped \
        --out "$RES/host-cost.json"
    run_part host-prof $(plan_of host-prof) host_profiles
    bench_part size-b gpu-b $(plan_of size-b)
else
    skip_part size-a "no CUDA device: the GPU matrix (preset gpu-a) needs one"
    skip_part size-b "no CUDA device: the GPU matrix (preset gpu-b) needs one"
    bench_part cpu-smoke cpu-smoke 120 15
fi
# shellcheck disable=SC2086  # RANK_TESTS: a list of paths without spaces
run_part gpu-ranks $(plan_of gpu-ranks) gpu_tests gpu-ranks $RANK_TESTS

# --- collect -----------------------------------------------------------------------------
TOTAL=$(( $(date +%s) - START ))
{
    echo "# tiermem GPU suite"
    echo
    echo "- Date: $(date -u +%FT%TZ); host $(hostname); commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)"
    echo "- GPU: $(nvidia-smi -L 2>/dev/null | head -1 || echo none)"
    [ "$HAVE_CUDA" = 1 ] || echo "- **Dry run: no CUDA device here.** CUDA parts skipped; the CPU smoke matrix ran instead."
    echo "- Python: $PY ($("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null))"
    echo "- NVMe dir: $NVME ($(stat -f -c %T "$NVME" 2>/dev/null)); tiermem cpu_budget: ${CPU_BUDGET:-default}"
    echo "- Total: ${TOTAL}s of a ${LIMIT}s budget"
    echo
    echo "| part | status | detail | seconds | limit |"
    echo "| --- | --- | --- | --- | --- |"
    while IFS=$'\t' read -r n s d t l; do
        echo "| $n | $s | $d | $t | $l |"
    done <"$STATUS"
    echo
    for n in gpu-tests gpu-ranks; do
        if [ -f "$LOGS/$n.log" ]; then
            echo "$n: \`$(grep -E '(passed|failed|skipped|error|no tests ran)' "$LOGS/$n.log" | tail -1)\`"
            echo
        fi
    done
    if [ -f "$RES/host-cost.json" ]; then
        echo "## host cost (bench_host_cost.py --device cuda): forward ms, synchronised / host"
        echo
        "$PY" benchmarks/bench_host_cost.py --summarize "$RES/host-cost.json"
        echo
    fi
    for stem in size-a size-b cpu-smoke; do
        if [ -f "$RES/$stem.md" ]; then
            sed 's/^## /## /' "$RES/$stem.md"
            echo
        fi
    done
    while IFS=$'\t' read -r n s d t l; do
        if [ "$s" != ok ] && [ "$s" != skipped ] && [ -f "$LOGS/$n.log" ]; then
            echo "### $n: $s ($d) — last 40 lines of logs/$n.log"
            echo
            echo '```'
            tail -n 40 "$LOGS/$n.log"
            echo '```'
            echo
        fi
    done <"$STATUS"
} >"$WORK/SUMMARY.md"

cp "$WORK/SUMMARY.md" "$OUT/SUMMARY.md"
for stem in size-a size-b cpu-smoke; do
    for f in "$stem.json" "$stem-pareto.png" "$stem-timeline.png"; do
        [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/$f"
    done
done
cp "$STATUS" "$LOGS/status.tsv"
cp "$RES"/*.md "$LOGS"/ 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs results 2>/dev/null \
    || tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs
n=$(find "$OUT" -maxdepth 1 -type f | wc -l)
say "done in ${TOTAL}s: $n files in $OUT"
head -40 "$OUT/SUMMARY.md" >&2
rm -rf "$WORK"
exit 0
