#!/usr/bin/env bash
# Every GPU check and figure on a CUDA machine, offline: the GPU tests, the sampler and
# gather figures, precompute on the GPU against the CPU, a CPU-vs-GPU profile with its
# operating points, served seeds/s per routing policy (in process and over HTTP), and the
# Fig. 10 SLO comparison. Nothing is installed from the network: packages the image lacks
# (httptools, orjson) come as wheels from WHEELS (default .whl/) into /tmp/site.
# Fetch them on a machine that reaches PyPI (the image's Python is 3.12), then carry .whl/:
#   pip download --only-binary=:all: --no-deps --python-version 3.12 --platform manylinux2014_x86_64 \
#       --platform manylinux_2_28_x86_64 httptools==0.7.1 orjson==3.13.0 -d .whl
#
#   bash bench/gpu_all.sh OUTDIR [STAGE ...]
#
# STAGE: env tests graph sampler lanecost precompute precompute_cli profile policies policies_http fig10 quiver
#        overload frontends
# (default: env tests sampler lanecost precompute profile policies policies_http fig10, in that
# order: all but graph, precompute_cli, quiver, overload and frontends; the products-scale graph
# is generated first, beside the tests (tests/gpu, then the gpu-marked tests elsewhere as
# tests_nccl, then the hybrid server test on CUDA); graph makes it beside the hybrid server
# test alone, for a fresh machine that needs no other test). overload is a CPU figure that needs the 16 cores:
# the front end's overload targets with the load generator on cores of its own (a 2-core
# machine cannot offer 4x its capacity without taking the server's CPU). frontends is the
# front-end processes' scaling figure, also CPU only, also needing the cores. Each stage
# writes OUTDIR/<stage>.log (and .json where it has figures) under its own time limit,
# so one that breaks leaves the others' results; a summary is printed last and written
# to OUTDIR/summary.txt. With ARCHIVE=FILE.tgz set, OUTDIR is also packed into FILE
# after every stage (so a run cut short still leaves what it measured).
#
# The stages' limits add up to about 34 minutes; a session has 15 of device time, the
# machine's start (about a minute) and its idle waits between calls included. Run them in
# two calls, back to back on the same warm machine (it is given back 30 s after a call, and
# a fresh one has neither the products graph nor the profile in data/: then begin with
# `graph profile`). Measured on an H200 (2026-11-27): env 16 s, tests 50 s and the hybrid
# CUDA test 48-67 s (the products graph, ~40 s, beside them), lanecost 26 s, profile
# 19-25 s, policies 107 s (engine) and 115-164 s (http) for gpu,hybrid,hybrid_slo,
# sampler 73 s, frontends 80 s (--trial-s 1.5 --bisect 1); tests_nccl and tests/gpu's
# torchrun precompute test not yet timed (tens of seconds). For the figures still open:
#   1. env tests lanecost profile policies policies_http   (~8 min)
#   2. fig10 quiver                                         (~4 min; quiver not yet timed)
# and, when a session has time left, sampler frontends precompute (~7 min).
set -u
OUTDIR=${1:?usage: bench/gpu_all.sh OUTDIR [STAGE ...]}
shift
STAGES=${*:-env tests sampler lanecost precompute profile policies policies_http fig10}  # precompute_cli, quiver, overload, frontends: ask for them
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUTDIR"
WHEELS=${WHEELS:-.whl}
PY=${PYTHON:-python3}
if ! $PY -c "import httptools" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
        || { echo "cannot install the wheels in $WHEELS" >&2; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export HYBRIDGNN_CACHE_DIR=${HYBRIDGNN_CACHE_DIR:-$ROOT/.cache}
# The whole-batch sampling kernels, the one-launch sampler for small batches, the
# one-kernel gather and CUDA graphs for small batches' forwards are on by default (set
# any to 0 to measure without; lanecost measures the GPU lane with and without graphs,
# and with graphs but without the one-launch sampler, regardless).
SUMMARY=$OUTDIR/summary.txt
: > "$SUMMARY"
[ -n "${GPU_NAME:-}" ] || GPU_NAME=$($PY -c "import torch; print(torch.cuda.get_device_name(0).split()[-1].lower())" 2>/dev/null || echo gpu)
# Made by the profile stage on this machine and kept in data/ (ignored, so a later call on
# the same warm machine finds it; the tree each call sends would overwrite profiles/). A
# profile names the weights it was made with, and the products model is regenerated on
# each machine: one made elsewhere matches only if its weights come out the same (and
# one made before aa44f38 named the weights file's bytes, which never do). OUTDIR gets a
# copy to commit.
PROFILE=data/products-sage3-256-$GPU_NAME.json
need_profile() {  # need_profile STAGE: the profile stage ran on this machine
    [ -f "$PROFILE" ] || { echo "$1: no $PROFILE: run the profile stage first on this machine" | tee -a "$SUMMARY"; return 1; }
}
# Whether torch sees a GPU, asked once. Without one (a CPU build of torch first on the
# path, a driver that does not load) every GPU stage would measure the CPU, or fail minutes
# in, under the GPU's name: each says so in one line instead. overload and frontends are
# CPU figures and run either way.
CUDA_STATE=$($PY -c "import torch; print('yes' if torch.cuda.is_available() else 'no: torch ' + torch.__version__ + ' (CUDA ' + str(torch.version.cuda) + ') sees no GPU')" 2>/dev/null)
[ -n "$CUDA_STATE" ] || CUDA_STATE="no: $PY cannot import torch"
need_cuda() {  # need_cuda STAGE: torch sees a GPU here
    [ "$CUDA_STATE" = yes ] || { echo "$1: skipped: $CUDA_STATE" | tee -a "$SUMMARY"; return 1; }
}

stage() {  # stage NAME LIMIT_S COMMAND...: run with a time limit, log, note the outcome
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s): $*" | tee -a "$OUTDIR/$name.log"
    timeout --signal=INT --kill-after=15 "$limit" "$@" >> "$OUTDIR/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - t0))s" | tee -a "$SUMMARY"
    tail -n 4 "$OUTDIR/$name.log" | sed 's/^/    /' >> "$SUMMARY"
    [ -z "${ARCHIVE:-}" ] || tar czf "$ARCHIVE" -C "$(dirname "$OUTDIR")" "$(basename "$OUTDIR")"
}

products() {  # the products-scale graph and the 3-layer SAGE (generated here, 16 cores)
    $PY -c "from bench.common import heavy_setup; print(heavy_setup())"
}

for s in $STAGES; do
    case $s in
    env)
        stage env 60 bash -c "nvidia-smi; $PY -c 'from hybridgnn.capabilities import describe_line; print(describe_line())'; \
            $PY -c 'import torch, torch_geometric, numba, httptools; print(torch.__version__, torch_geometric.__version__, numba.__version__)'; nproc; free -g"
        ;;
    tests|graph)  # graph: the products graph with only the hybrid server test beside it
        need_cuda "$s" || continue
        products > "$OUTDIR/products.log" 2>&1 &
        GEN=$!
        [ "$s" = graph ] || stage tests 150 $PY -m pytest -q -m gpu -p no:cacheprovider tests/gpu tests/unit
        # the gpu-marked tests outside tests/gpu (partition ranks over NCCL), a stage of their
        # own: a rank group that hangs waits out its 120 s timeout without taking tests' results
        [ "$s" = graph ] || stage tests_nccl 90 $PY -m pytest -q -m gpu -p no:cacheprovider \
            tests/integration/test_partitioned_cgp.py
        export HYBRIDGNN_TEST_DEVICE=cuda
        stage tests_hybrid_cuda 120 $PY -m pytest -q -p no:cacheprovider tests/integration/test_hybrid.py
        wait $GEN; echo "products graph: exit $? ($(tail -n 1 "$OUTDIR/products.log"))" | tee -a "$SUMMARY"
        ;;
    sampler)
        need_cuda sampler || continue
        stage sampler 150 $PY bench/gpu_sampler.py --seconds 0.5 --out "$OUTDIR/sampler.json"
        ;;
    lanecost)  # each lane's fixed cost per small batch: GPU lane, split CPU lane, CPU-model lane
        need_cuda lanecost || continue
        stage lanecost 150 $PY bench/lane_cost.py --heavy --sizes 1,4,16 --batches 100 --out "$OUTDIR/lanecost.json"
        ;;
    precompute)
        need_cuda precompute || continue
        stage precompute 230 $PY bench/precompute_device.py --heavy --out "$OUTDIR/precompute.json"
        ;;
    precompute_cli)  # the command a user runs, end to end on the GPU
        need_cuda precompute_cli || continue
        stage precompute_cli 150 $PY -m hybridgnn.cli.main precompute --dataset data/products-powerlaw \
            --model data/products-sage3-256 --device cuda
        ;;
    profile)
        need_cuda profile || continue
        stage profile 120 $PY -m hybridgnn.cli.main --log-level WARNING profile --dataset data/products-powerlaw \
            --model data/products-sage3-256 --device cuda --budget-s 40 --min-samples 40 --out "$PROFILE"
        cp "${PROFILE%.json}".* "$OUTDIR"/ 2>/dev/null
        ;;
    policies|policies_http)  # in process, then over HTTP: one stage each (a policy and mode takes ~75 s)
        # Doubling from 200 req/s reaches the H200's maxima (550-1,100 req/s) in 3-4 trials,
        # leaving 5 bisection steps for about the trials 50 and 3 took: each maximum to
        # within ~25 req/s (3 %) instead of ~100, finer than the 1.3 the ratio must clear.
        mode=engine; [ "$s" = policies ] || mode=http
        need_cuda "$s" && need_profile "$s" || continue
        stage "$s" 330 $PY bench/hybrid_policies.py --heavy --slo-ms 30 --trial-s 2.5 --start-rate 200 --bisect-steps 5 --modes $mode \
            --policies "${POLICIES:-gpu,hybrid}" --profile "$PROFILE" --out "$OUTDIR/$s.json"
        ;;
    quiver)  # the 2-layer [15,10] SAGE of Quiver's products setting, in process, GPU only and hybrid
        need_cuda quiver || continue
        stage quiver 300 $PY bench/hybrid_policies.py --heavy --layers 2 --slo-ms 30 --trial-s 2.5 --start-rate 200 \
            --modes engine --policies gpu,hybrid --out "$OUTDIR/quiver.json"
        ;;
    fig10)
        need_cuda fig10 && need_profile fig10 || continue
        stage fig10 290 $PY bench/slo_batching.py --heavy --device cuda --profile "$PROFILE" --slo-ms 30 \
            --nodes-per-request 16 --rounds 1 --duration-s 6 --warmup-s 2 --max-rate 4000
        ;;
    overload)  # no baseline: the machine has the working tree, not the git history
        # load generator on cores 0-1, event loop on 2-3, CPU worker processes on 4-15
        stage overload 200 $PY bench/overload.py --servers current --parts sampled --nodes-per-request 64 \
            --start-rate 2000 --multiples 1,2,4 --duration-s 5 --client-cpus 0,1 \
            --server-flags="--device cpu" --current-flags="--worker-cpus 4-15" --json "$OUTDIR/overload.json"
        ;;
    frontends)  # CPU only: one-seed lookups served within p99 30 ms, 4 front ends / 1 (server on 8 cores)
        stage frontends 240 $PY bench/frontend_scaling.py --frontends 1,4 --server-cpus 0-7 --client-cpus 8-15 \
            --clients 6 --trial-s 2 --bisect 2 --out "$OUTDIR/frontends.json"
        ;;
    *) echo "unknown stage $s" | tee -a "$SUMMARY" ;;
    esac
done
echo "===== summary"
cat "$SUMMARY"
