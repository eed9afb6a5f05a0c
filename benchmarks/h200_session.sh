#!/usr/bin/env bash
# The GPU runs behind BENCHMARKS.md, in one device call per part. Run from the repo root on an H200 machine:
#   bash benchmarks/h200_session.sh two [gpt|llama|gpt,llama]
#                                             # 2 GPUs (issue #15): PyTorch 1F1B eager and with compiled blocks
#                                             # (every schedule it allows), fnpipe auto and fx for 1f1b / zb-h1 /
#                                             # interleaved-1f1b / zbv, then a warm restart. Cold compiles make
#                                             # both families' full set about 2 x 10 min: one family per call gets
#                                             # every row; both in one call get the rows the budget allows, in
#                                             # priority order (baselines, fnpipe's default on 1f1b / zb-h1, ...)
#   bash benchmarks/h200_session.sh warm [llama] # 2 GPUs: the default 1f1b cold, then warm twice: setup phases
#   bash benchmarks/h200_session.sh one       # 1 GPU: eager autograd, torch.func.grad, fnpipe one stage fx / auto
#   bash benchmarks/h200_session.sh profile   # 1 GPU: one stage kernel by kernel against torch.func.grad
#   bash benchmarks/h200_session.sh stages    # 1 GPU: a p = 4 zbv plan's stage costs against its programs in turn
#   bash benchmarks/h200_session.sh examples  # 2 GPUs: examples/train_gpt.py under torchrun and mpirun
#   bash benchmarks/h200_session.sh four      # 4 GPUs: depth 4, both families, every schedule; the model on one GPU
#   bash benchmarks/h200_session.sh fourdp    # 4 GPUs: NCCL equivalence at 4 ranks, then DP2 x PP2
#   bash benchmarks/h200_session.sh fourzbv   # 4 GPUs: zbv at p = 4, the planner's room against room 2 and gated
#   bash benchmarks/h200_session.sh fourcopy  # 4 GPUs: copy-engine channels (FNPIPE_P2P=copy): NCCL equivalence at
#                                             # 2 ranks with them, then zbv and 1f1b at p = 4 with and without
#   bash benchmarks/h200_session.sh fourall   # 4 GPUs: depth 4 and DP2 x PP2, fnpipe's default only, in one command
#   bash benchmarks/h200_session.sh fourwhy   # 4 GPUs: why programs run slower in a step than in turn: per
#                                             # program kernels and span, allocator counters; GPT zbv at p = 4
#                                             # and ResNet-101x4 1f1b at p = 2, each ungated and gated
#   bash benchmarks/h200_session.sh fourdata  # 4 GPUs: zbv's programs timed in turn on stand-ins, on a step's own
#                                             # operands and in the step (is the in-step slowdown the data?)
#   bash benchmarks/h200_session.sh fourhost  # 4 GPUs: zbv's host time per program in a step, launch from idle and
#                                             # as a CUDA graph; inductor's Python wrapper against its C++ wrapper
#   bash benchmarks/h200_session.sh fourgraphs # 4 GPUs: CUDA graphs: equivalence at 2 ranks, zbv at p = 4 with and
#                                             # without, the one-GPU rows for the share of ideal
#   bash benchmarks/h200_session.sh fourpower # 4 GPUs: graphs' equivalence at 2 ranks; GPT's one-GPU rows alone, then
#                                             # on four GPUs at once, then alone (is "of ideal" attainable at p = 4?)
#   bash benchmarks/h200_session.sh foursettle # 4 GPUs: zbv at p = 4 with graphs, programs timed after 0 / 0.5 / 2 s
#                                             # of sustained load (FNPIPE_PROFILE_SETTLE): the start-up clock
#   bash benchmarks/h200_session.sh fourcal   # 4 GPUs: a fresh settled calibration, then zbv at p = 4 with and
#                                             # without graphs against compiled PyTorch 1F1B, both families
#   bash benchmarks/h200_session.sh fourplan  # 4 GPUs: the planner on a fresh calibration's regions: the Llama's zbv
#                                             # with and without graphs, then GPT's zbv with graphs and copy engines
#   bash benchmarks/h200_session.sh fourcheck # 4 GPUs: gated receives' equivalence over NCCL, the same plan started
#                                             # three times in one process (restarts.py), one traced zbv step with
#                                             # the SM clock and power sampled every 10 ms beside it
#   bash benchmarks/h200_session.sh resnet    # 2 GPUs (issue #24): ResNet-101x4, DDP and fnpipe fx / inductor on a fresh
#                                             # calibration (the median program scale), then both on one GPU
#   bash benchmarks/h200_session.sh schedlib  # 2 GPUs: the schedule library beside PyTorch's same-named schedules,
#                                             # schedule="auto", and the dualpipev overlap trace (4 GPUs: P=4 too)
# Writes JSON and the log under $OUT (else out/); each launch has its own time budget and limit, so one hang
# does not take the others with it. The tables come last in the log. Each part fits one 10-minute command.
# HOST_SETTLE=0.03 first waits for the host's pace to settle (benchmarks/host_pace.py); HOST_PACE=1 samples it
# beside the part into $OUT/pace_during.txt.
set -uo pipefail
part=${1:?usage: h200_session.sh two|warm|one|stages|profile|examples|four|fourzbv|fourcopy|fourwhy|fourdata|fourhost|fourgraphs|fourpower|foursettle|fourcal|fourplan|fourcheck|fourdp|fourall|resnet|resnetwhy|schedlib}
families=${2:-gpt,llama}
out=${OUT:-out}
cal=${CAL_DIR:-/tmp/fnpipe_cal}  # op timings, kept between the parts of one machine's session
mkdir -p "$out" "$cal"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$cal/inductor}  # compiled kernels, reused by later launches
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} OMP_NUM_THREADS=4
export ENGINE_LOG_LEVEL_RUNTIME=${ENGINE_LOG_LEVEL_RUNTIME:-INFO}  # why a re-split was made or not (engine.execution.rebalance)
log="$out/log_$part.txt"
bench() { timeout "$1" torchrun --nproc_per_node "$2" --master-port "$3" benchmarks/gpu_pipeline.py "${@:4}"; }
graphs_equivalence() {  # CUDA graphs' float64 and float32 equivalence over NCCL at 2 ranks (GPUs 0,1), three steps a
                        # case: eager, capture, replay with another batch and new parameter tensors
  FNPIPE_CUDA_GRAPHS=1 FNPIPE_EQ_STEPS=3 CUDA_VISIBLE_DEVICES=0,1 \
    timeout "$1" mpirun --allow-run-as-root -n 2 python3 tests/mpi/equivalence.py > "$out/equivalence_graphs.txt" 2>&1
  echo "CUDA-graph equivalence over NCCL, 2 ranks: exit $?, $(grep -c '^OK' "$out/equivalence_graphs.txt") OK," \
    "$(grep -c "^FAIL" "$out/equivalence_graphs.txt") FAIL, $(grep -c "compute instructions captured" "$out/equivalence_graphs.txt") captures, $(grep -c "CUDA graphs off" "$out/equivalence_graphs.txt") off"
  grep -v '^OK' "$out/equivalence_graphs.txt" | grep -v -E "^\[W|warn|INFO\]" | tail -n 12
}
sample_gpus() {  # every GPU's SM clock, power and throttle reasons every 100 ms into $1 (benchmarks/power_phases.py);
                 # run with `&`: exec makes the background job nvidia-smi itself, so `kill $!` stops it
  exec nvidia-smi --query-gpu=timestamp,index,utilization.gpu,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader -lms 100 > "$1"
}
{
  date -u; nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv; nvidia-smi topo -m
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  if [ -n "${HOST_SETTLE:-}" ]; then  # a fresh machine's host is slow for its first minutes (NOTES.md): wait until
                                     # its pace holds within HOST_SETTLE (a fraction) for five probes, at most
                                     # HOST_SETTLE_MAX seconds, before the part starts
    CUDA_VISIBLE_DEVICES=0 python3 benchmarks/host_pace.py --cuda --settle "$HOST_SETTLE" \
      --seconds "${HOST_SETTLE_MAX:-120}" --every 3 --out "$out/pace_settle.csv"
  fi
  if [ "${HOST_PACE:-0}" = 1 ]; then  # the host's pace sampled beside the part (CPU work only), every 5 s
    python3 benchmarks/host_pace.py --seconds 3600 --every 5 --out "$out/pace_during.csv" \
      > "$out/pace_during.txt" 2>&1 &
    pace_pid=$!
  fi
  case $part in
    two)  # at most 440 + 120 s: the budgets end each launch in time, `timeout` is the backstop
      export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
      # TWO_LIMIT, COMPILERS, SCHEDULES, TORCH_EAGER, TORCH_COMPILED, TORCH_RISKY trim the first launch;
      # WARMUP and STEPS as fourcal's; WARM=0 leaves out the warm restart; GRAPHS_EQ=1 first runs the CUDA
      # graphs' equivalence over NCCL (as fourgraphs does)
      [ "${GRAPHS_EQ:-0}" = 1 ] && graphs_equivalence "${EQ_TIMEOUT:-120}"
      limit=${TWO_LIMIT:-470}
      bench "$limit" 2 29514 --budget $((limit - 40)) --families "$families" --calibrate "$cal" --one-gpu-layers 0 \
        --timeout 300 --warmup "${WARMUP:-2}" --steps "${STEPS:-5}" --compilers "${COMPILERS:-auto,fx}" \
        --schedules "${SCHEDULES:-1f1b,zb-h1,interleaved-1f1b,zbv}" \
        --torch-eager "${TORCH_EAGER-1f1b}" --torch-compiled "${TORCH_COMPILED-1f1b,gpipe,interleaved-1f1b}" \
        --torch-risky "${TORCH_RISKY-zb-h1,zbv,interleaved-zb}" --out-dir "$out"
      # warm restart: the compile cache and calibration tables the launch above left, fnpipe's default only
      [ "${WARM:-1}" = 0 ] || mkdir -p "$out/warm"
      [ "${WARM:-1}" = 0 ] || bench 130 2 29515 --budget 115 --min-row 20 --families "$families" --calibrate "$cal" \
        --schedules 1f1b --compilers auto \
        --torch-eager "" --torch-compiled "" --torch-risky "" --one-gpu-layers 0 --warmup 1 --steps 3 --out-dir "$out/warm"
      ;;
    warm)  # 2 GPUs: fnpipe's default 1f1b launched on a cold compile cache, then twice warm (the cache and the
           # calibration of the launches before): each rank's setup phases (engine.setup_clock) in the log
      export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
      for run in ${RUNS:-cold warm warm2}; do  # at most 190 + 2 x 160 s
        mkdir -p "$out/$run"
        limit=$([ "$run" = cold ] && echo 190 || echo 160)
        bench "$limit" 2 29515 --budget $((limit - 15)) --min-row 20 --families "$families" --calibrate "$cal" --schedules 1f1b \
          --compilers auto --torch-eager "" --torch-compiled "" --torch-risky "" --one-gpu-layers 0 --warmup 1 \
          --steps 3 --out-dir "$out/$run"
      done
      grep -h "setup \|compiled in\|parallelize to first step" "$log" | cut -c1-400
      ;;
    one)
      export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
      limit=${ONE_LIMIT:-560}  # ONE_LIMIT trims it to what a session's device time has left
      timeout "$limit" python3 benchmarks/gpu_pipeline.py --single --budget $((limit - 30)) --families "$families" \
        --one-gpu-layers 8 --one-gpu-paired "${PAIRED:-20}" --compilers "${COMPILERS:-auto,fx}" \
        --one-gpu-rows "${ONE_GPU_ROWS:-eager,grad,fnpipe}" --calibrate "$cal" --out-dir "$out"
      ;;
    stages)  # 1 GPU: the planner's stage costs of a p = 4 zbv plan against its stage programs timed in turn, with
             # and without the head timed as a piece (TABLES=now: the current calibration alone, about half the time)
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} ENGINE_LOG_LEVEL_CALIBRATE=INFO timeout "${STAGES_LIMIT:-560}" \
        python3 benchmarks/stage_check.py --families "$families" --tables "${TABLES:-before,now}" \
        --out-dir "$out/stages"
      ;;
    profile)
      CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/profile_stage.py --calibrate "$cal" \
        --variants fx,cheap,inductor --out "$out/profile.json"
      ;;
    examples)
      export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
      timeout 200 torchrun --nproc_per_node 2 --master-port 29520 examples/train_gpt.py --steps 100 --schedule 1f1b \
        --log-every 20 --compiler fx
      timeout 200 mpirun --allow-run-as-root -n 2 python3 examples/train_gpt.py --steps 100 --schedule zb-h1 \
        --log-every 20
      ;;
    four)  # 4 GPUs, depth 4, both families: the baselines, fnpipe's default on every schedule, then the whole
           # model on one GPU (eager autograd, torch.func.grad, fnpipe one stage) for the share of ideal speed-up;
           # WARMUP and STEPS as fourcal's; ONE_GPU_LAYERS=0 leaves out the one-GPU rows
      bench 570 4 29516 --budget 540 --families "$families" --calibrate "$cal" --one-gpu-layers "${ONE_GPU_LAYERS:-16}" \
        --compilers auto \
        --schedules zbv,1f1b,interleaved-1f1b,zb-h1 --torch-eager 1f1b --torch-compiled 1f1b,interleaved-1f1b \
        --torch-risky "" --timeout 240 --warmup "${WARMUP:-2}" --steps "${STEPS:-5}" --out-dir "$out"
      ;;
    fourzbv)  # 4 GPUs: zbv at p = 4 as the planner chooses its room (refine.ROOMS), against session 16's single
              # room of 2 and with gated receives, each family's one-GPU fnpipe row last for the share of ideal
      bench 575 4 29516 --budget 545 --families "$families" --calibrate "$cal" --one-gpu-layers 16 --one-gpu-rows fnpipe \
        --compilers auto,auto-room2,auto-gated --schedules zbv --torch-eager "" --torch-compiled 1f1b --torch-risky "" \
        --timeout 240 --out-dir "$out"
      ;;
    fourcopy)  # 4 GPUs: copy-engine channels (engine/execution/copies.py). Their float64 equivalence over NCCL
               # at 2 ranks first (GPUs 0,1), then zbv and 1f1b at p = 4, NCCL's kernels against the copy engines
               # in one launch, each family's one-GPU fnpipe row last for the share of ideal
      FNPIPE_P2P=copy ENGINE_LOG_LEVEL_LAUNCH=INFO CUDA_VISIBLE_DEVICES=0,1 timeout "${EQ_TIMEOUT:-120}" \
        mpirun --allow-run-as-root -n 2 python3 tests/mpi/equivalence.py > "$out/equivalence_copy.txt" 2>&1
      echo "copy-engine equivalence over NCCL, 2 ranks: exit $?, $(grep -c '^OK' "$out/equivalence_copy.txt") OK," \
        "$(grep -c '^FAIL' "$out/equivalence_copy.txt") FAIL, $(grep -c 'copy-engine channels from' \
        "$out/equivalence_copy.txt") opened"; grep -v '^OK' "$out/equivalence_copy.txt" | tail -n 20
      bench "${BENCH_TIMEOUT:-440}" 4 29516 --budget "${BENCH_BUDGET:-410}" --families "$families" --calibrate "$cal" \
        --one-gpu-layers 16 --one-gpu-rows fnpipe --compilers "${COMPILERS:-auto,auto-copy}" \
        --schedules "${SCHEDULES:-zbv,1f1b}" --torch-eager "" --torch-compiled 1f1b --torch-risky "" --timeout 240 \
        --out-dir "$out"
      ;;
    fourgraphs)  # 4 GPUs: CUDA graphs of the compute instructions (engine/execution/graphs.py). Their float64 and
                 # float32 equivalence over NCCL at 2 ranks first (GPUs 0,1; three steps a case: eager, capture,
                 # replay with another batch and new parameter tensors), then zbv at p = 4 without and with them
                 # in one launch, each family's one-GPU fnpipe rows (without and with) last for the share of ideal
      graphs_equivalence "${EQ_TIMEOUT:-120}"
      calib=(); nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H100 && [ -n "$(ls "$cal"/*.json 2>/dev/null)" ] \
        && calib=(--calibrate "$cal")  # H100 tables carried in; elsewhere uncalibrated (no time to calibrate)
      bench "${BENCH_TIMEOUT:-440}" 4 29516 --budget "${BENCH_BUDGET:-410}" --families "$families" "${calib[@]}" \
        --one-gpu-layers 16 --one-gpu-rows fnpipe --compilers "${COMPILERS:-auto,auto-graphs}" \
        --schedules "${SCHEDULES:-zbv}" --torch-eager "" --torch-compiled 1f1b --torch-risky "" --timeout 240 \
        --out-dir "$out"
      ;;
    fourall)  # 4 GPUs, one command: depth 4 (zbv, 1f1b, interleaved-1f1b), then DP2 x PP2 (1f1b), each row's
              # predictions beside it: the planner's and the one from the stage programs measured on the device
      mkdir -p "$out/p4" "$out/dp2"
      bench 320 4 29516 --budget 300 --families "$families" --calibrate "$cal" --one-gpu-layers 0 --compilers auto \
        --schedules zbv,1f1b,interleaved-1f1b --torch-eager 1f1b --torch-compiled 1f1b --torch-risky "" \
        --timeout 240 --out-dir "$out/p4"
      bench 230 4 29517 --budget 210 --families "$families" --dp 2 --calibrate "$cal" --schedules 1f1b --compilers auto \
        --torch-eager "" --torch-compiled 1f1b --torch-risky "" --one-gpu-layers 0 --out-dir "$out/dp2"
      ;;
    fourwhy)  # 4 GPUs: why programs run slower inside a step than timed in turn (NOTES.md, Open): each program's
              # kernels and span in a step against in turn (program_kernels.py) and the caching allocator's
              # counters over the timed steps; GPT zbv at p = 4 ungated then gated, then ResNet-101x4 1f1b at
              # p = 2 on GPUs 0,1 (ungated) and 2,3 (gated) at once. Profiler traces stay on the machine.
      why=/tmp/fnpipe_why; mkdir -p "$why"/{gpt,gpt_gated,resnet,resnet_gated} "$out/why"
      diag() { OUT="$why/$1" timeout "$2" torchrun --nproc_per_node "$3" --master-port "$4" benchmarks/diagnose_p2.py \
                 --compilers auto --timeout 240 "${@:5}" > "$out/why/$1.txt" 2>&1; echo "== $1: exit $?"; }
      diag gpt 170 4 29518 --families "${families%%,*}" --schedule zbv
      FNPIPE_GATED_RECV=1 diag gpt_gated 170 4 29519 --families "${families%%,*}" --schedule zbv
      CUDA_VISIBLE_DEVICES=0,1 diag resnet 210 2 29522 --families resnet --schedule 1f1b &
      CUDA_VISIBLE_DEVICES=2,3 FNPIPE_GATED_RECV=1 diag resnet_gated 210 2 29524 --families resnet --schedule 1f1b &
      wait
      for f in "$why"/*/spans_*.json; do [ -f "$f" ] && gzip -c "$f" > "$out/why/$(basename "$(dirname "$f")")_$(basename "$f").gz"; done
      for f in "$out"/why/*.txt; do echo "==== $f"; grep -v -E "^\s+[0-9]+: |^\[W|UserWarning|warnings.warn" "$f" | tail -n 60; done
      ;;
    fourpower)  # 4 GPUs: does a GPU run the same work slower while the other three run too? (zbv's "of ideal"
                # divides by a one-GPU row run alone.) GPT's one-GPU rows (eager autograd, fnpipe one stage auto,
                # 16 blocks, 30 steps) alone on GPU 0, then on all four at once (four processes, no communication),
                # then alone again; nvidia-smi samples SM clock, power and throttle reasons every 100 ms beside it.
                # First the CUDA-graph equivalence at 2 ranks (as in fourgraphs)
      graphs_equivalence "${EQ_TIMEOUT:-150}"
      mkdir -p "$out/power"
      alone() { CUDA_VISIBLE_DEVICES=$1 timeout "$2" python3 benchmarks/gpu_pipeline.py --single --families gpt \
                  --one-gpu-layers 16 --one-gpu-rows eager,fnpipe --compilers "${COMPILERS:-auto}" --steps 30 \
                  --out-dir "$out/power/$3" > "$out/power/$3.txt" 2>&1; echo "== $3 (GPU $1): exit $?"; }
      sample_gpus "$out/power/smi.csv" & smi=$!
      phase() { echo "$1 $(date -u +%Y/%m/%d\ %H:%M:%S.%3N)" >> "$out/power/phases.txt"; }
      phase solo1; alone 0 170 solo1
      phase four; pids=(); for g in 0 1 2 3; do alone $g 120 four$g & pids+=($!); done; wait "${pids[@]}"
      phase solo2; alone 0 90 solo2; phase end
      kill $smi
      for f in "$out"/power/solo1.txt "$out"/power/four?.txt "$out"/power/solo2.txt; do
        echo "==== $f"; grep -E "\] gpt: .* s/step" "$f"; done
      python3 benchmarks/power_phases.py "$out/power/smi.csv" "$out/power/phases.txt"
      ;;
    foursettle)  # 4 GPUs: are the programs timed at start-up faster than in a step because a short burst from
                 # idle runs at a higher clock than a power-capped step? zbv at p = 4 with CUDA graphs, each family
                 # launched with the programs timed after 0, 0.5 (the default) and 2 s of them back to back
                 # (FNPIPE_PROFILE_SETTLE); the measured / programs column is the answer. nvidia-smi beside it
      calib=(); nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H100 && [ -n "$(ls "$cal"/*.json 2>/dev/null)" ] \
        && calib=(--calibrate "$cal")
      mkdir -p "$out/settle"
      sample_gpus "$out/settle/smi.csv" & smi=$!
      phase() { echo "$1 $(date -u +%Y/%m/%d\ %H:%M:%S.%3N)" >> "$out/settle/phases.txt"; }
      port=29530
      for fam in ${families//,/ }; do
        for settle in ${SETTLES:-0 0.5 2}; do
          phase "${fam}_$settle"; port=$((port + 1))
          FNPIPE_PROFILE_SETTLE=$settle bench "${BENCH_TIMEOUT:-150}" 4 $port --budget "${BENCH_BUDGET:-130}" --families "$fam" \
            "${calib[@]}" --one-gpu-layers 0 --compilers "${COMPILERS:-auto-graphs}" --schedules "${SCHEDULES:-zbv}" \
            --torch-eager "" --torch-compiled "" --torch-risky "" --timeout 120 --out-dir "$out/settle/${fam}_$settle" \
            > "$out/settle/${fam}_$settle.txt" 2>&1
          echo "== $fam settle $settle: exit $?"
          grep -E "measured / predicted|parallelize to first" "$out/settle/${fam}_$settle.txt"
          grep -E "^fnpipe " "$out/settle/${fam}_$settle.txt" | tail -n 1
        done
      done
      phase end; kill $smi
      python3 benchmarks/power_phases.py "$out/settle/smi.csv" "$out/settle/phases.txt"
      ;;
    fourcal)  # 4 GPUs: a fresh calibration with its programs timed at a step's clock (FNPIPE_PROFILE_SETTLE), then
              # zbv at p = 4 with CUDA graphs and without against compiled PyTorch 1F1B, both families: the
              # planner's prediction and the programs' from settled timings. ONE_GPU_LAYERS=16 adds each family's
              # one-GPU fnpipe rows (same compilers, or ONE_GPU_COMPILERS) for "of ideal" in the same launch
              # (about 100 s more a family and compiler); WARMUP and STEPS: each row's steps before timing and timed
      fresh=/tmp/fnpipe_cal_fresh; mkdir -p "$fresh"
      bench "${BENCH_TIMEOUT:-520}" 4 29540 --budget "${BENCH_BUDGET:-490}" --families "$families" --calibrate "$fresh" \
        --one-gpu-layers "${ONE_GPU_LAYERS:-0}" --one-gpu-rows fnpipe --one-gpu-compilers "${ONE_GPU_COMPILERS:-}" \
        --compilers "${COMPILERS:-auto-graphs,auto}" \
        --schedules "${SCHEDULES:-zbv}" --torch-eager "" --torch-compiled 1f1b --torch-risky "" --timeout 240 \
        --warmup "${WARMUP:-2}" --steps "${STEPS:-5}" --out-dir "$out"
      cp "$fresh"/cal_*.json "$out/" 2>/dev/null
      ;;
    fourplan)  # 4 GPUs: the planner on a fresh calibration's regions (B and W from their own programs, each region
               # timed twice), each family its own launch: the Llama's zbv with and without CUDA graphs, then GPT's
               # zbv with graphs and copy engines against compiled PyTorch 1F1B (graphs' memory in the prediction)
      fresh=/tmp/fnpipe_cal_fresh; mkdir -p "$fresh" "$out/llama" "$out/gpt"
      ENGINE_LOG_LEVEL_CALIBRATE=INFO bench "${LLAMA_TIMEOUT:-330}" 4 29541 --budget "${LLAMA_BUDGET:-310}" --families llama \
        --calibrate "$fresh" --one-gpu-layers 0 --compilers "${LLAMA_COMPILERS:-auto-graphs,auto}" --schedules zbv \
        --torch-eager "" --torch-compiled "" --torch-risky "" --timeout 240 --out-dir "$out/llama"
      ENGINE_LOG_LEVEL_CALIBRATE=INFO bench "${GPT_TIMEOUT:-220}" 4 29542 --budget "${GPT_BUDGET:-205}" --families gpt \
        --calibrate "$fresh" --one-gpu-layers 0 --compilers "${GPT_COMPILERS:-auto-graphs-copy}" --schedules zbv \
        --torch-eager "" --torch-compiled 1f1b --torch-risky "" --timeout 200 --out-dir "$out/gpt"
      cp "$fresh"/cal_*.json "$out/" 2>/dev/null
      ;;
    fourdata)  # 4 GPUs: is a program slower in a step because of its data? zbv at p = 4, each program timed in turn
               # on start-up's stand-ins, on the operands a step gave it, and in the step (diagnose_p2.py --real),
               # with the kernels-or-gaps tables: GPT and the Llama over NCCL, then GPT over the copy engines
      why=/tmp/fnpipe_data; mkdir -p "$why"/{gpt,llama,gpt_copy} "$out/data"
      diag() { OUT="$why/$1" timeout "$2" torchrun --nproc_per_node 4 --master-port "$3" benchmarks/diagnose_p2.py \
                 --compilers auto --timeout 200 --schedule zbv --real --host "${@:4}" > "$out/data/$1.txt" 2>&1; echo "== $1: exit $?"; }
      diag gpt 175 29518 --families gpt
      diag llama 175 29519 --families llama
      FNPIPE_P2P=copy CUDA_DEVICE_MAX_CONNECTIONS=32 diag gpt_copy 175 29520 --families gpt
      for f in "$out"/data/*.txt; do echo "==== $f"; grep -v -E "^\s+[0-9]+: |^\[W|UserWarning|warnings.warn|INFO\]" "$f" | tail -n 75; done
      ;;
    fourhost)  # 4 GPUs: is a step's rank launch-bound? zbv at p = 4: the host's time per program in a step, each
               # program's launch time from idle and as one CUDA graph (diagnose_p2.py --real --host); GPT with
               # inductor's Python wrapper, then its C++ wrapper (TORCHINDUCTOR_CPP_WRAPPER=1), then the Llama
      why=/tmp/fnpipe_host; mkdir -p "$why"/{gpt,gpt_cpp,llama} "$out/host"
      diag() { OUT="$why/$1" timeout "$2" torchrun --nproc_per_node 4 --master-port "$3" benchmarks/diagnose_p2.py \
                 --compilers auto --timeout 200 --schedule zbv --real --host "${@:4}" > "$out/host/$1.txt" 2>&1; echo "== $1: exit $?"; }
      diag gpt 150 29518 --families gpt
      TORCHINDUCTOR_CPP_WRAPPER=1 diag gpt_cpp 240 29519 --families gpt
      diag llama 150 29520 --families llama
      for f in "$out"/host/*.txt; do echo "==== $f"; grep -E "^\| (gpt|llama) auto" "$f"; sed -n "/the host.s time in one step/,\$p" "$f" | grep -v -E "^\[W|Warn|warn" | head -60; done
      ;;
    resnetwhy)  # 2 GPUs: ResNet-101x4 1f1b, inductor then fx, uncalibrated: the step against its programs, each
                # program's kernels, span and gaps in a profiled step against in turn (NOTES.md, Open)
      export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
      OUT=/tmp/fnpipe_why_resnet timeout "${RESNET_TIMEOUT:-420}" torchrun --nproc_per_node 2 --master-port 29525 \
        benchmarks/diagnose_p2.py --families resnet --compilers auto,fx --schedule 1f1b --timeout 240 \
        > "$out/resnetwhy.txt" 2>&1; echo "== resnetwhy: exit $?"
      for f in /tmp/fnpipe_why_resnet/spans_*.json; do [ -f "$f" ] && gzip -c "$f" > "$out/resnetwhy_$(basename "$f").gz"; done
      grep -v -E "^\s+[0-9]+: |^\[W|UserWarning|warnings.warn|INFO\]" "$out/resnetwhy.txt" | tail -n 120
      ;;
    fourcheck)  # 4 GPUs: what session 12 left (benchmarks/NOTES.md, Open)
      FNPIPE_GATED_RECV=1 ENGINE_LOG_LEVEL_LAUNCH=INFO timeout 150 mpirun --allow-run-as-root -n 4 \
        python3 tests/mpi/equivalence.py > "$out/equivalence_gated.txt" 2>&1
      echo "gated equivalence over NCCL, 4 ranks: exit $?, $(grep -c '^OK' "$out/equivalence_gated.txt") OK lines," \
        "$(grep -c '^FAIL' "$out/equivalence_gated.txt") FAIL, $(grep -c 'gated receives from' "$out/equivalence_gated.txt") gated"
      timeout 200 torchrun --nproc_per_node 4 --master-port 29520 benchmarks/restarts.py --family llama --schedule zbv
      nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,utilization.gpu --format=csv,noheader -lms 10 \
        > "$out/smi_10ms.csv" & smi=$!
      mkdir -p "$out/why"
      OUT="$out/why" timeout 150 torchrun --nproc_per_node 4 --master-port 29521 benchmarks/diagnose_p2.py \
        --families gpt --compilers auto --schedule zbv --timeout 240
      kill $smi
      ;;
    fourdp)  # 4 GPUs: NCCL equivalence at 4 ranks, then DP2 x PP2 (the DP all-reduce buffers in the memory model).
             # EQ=0 leaves out the equivalence; DP_LIMIT, DP_SCHEDULES, DP_COMPILERS, STEPS trim the DP launch
      # 112 of the 128 cases took 150 s on 4 x H100 (session 17); session 9's H200s ran all of them in 100 s
      if [ "${EQ:-1}" = 1 ]; then
        timeout 240 mpirun --allow-run-as-root -n 4 python3 tests/mpi/equivalence.py > "$out/equivalence.txt" 2>&1
        echo "equivalence over NCCL, 4 ranks: exit $?, $(grep -c '^OK' "$out/equivalence.txt") OK lines"; tail -n 2 "$out/equivalence.txt"
      fi
      mkdir -p "$out/dp2"; limit=${DP_LIMIT:-320}
      bench "$limit" 4 29517 --budget $((limit - 20)) --families "$families" --dp 2 --calibrate "$cal" \
        --schedules "${DP_SCHEDULES:-1f1b,zb-h1}" --compilers "${DP_COMPILERS:-auto,fx}" --torch-eager "" \
        --torch-compiled 1f1b --torch-risky "" --one-gpu-layers 0 --warmup "${WARMUP:-2}" --steps "${STEPS:-5}" \
        --out-dir "$out/dp2"
      ;;
    resnet)  # 2 GPUs: the planner against the ResNet rows, calibrated afresh in the first launch
      export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
      rm -f "$cal/resnet.json"
      timeout "${RESNET_TIMEOUT:-420}" torchrun --nproc_per_node 2 --master-port 29523 benchmarks/resnet_bench.py --model resnet101x4 \
        --rows fnpipe,ddp --compiler fx,inductor --calibrate "$cal/resnet.json" --steps 5 --json "$out/resnet2.json"
      [ "${RESNET_ONE_GPU:-1}" = 1 ] && CUDA_VISIBLE_DEVICES=0 timeout 170 python3 benchmarks/resnet_bench.py \
        --model resnet101x4 --rows fnpipe --compiler fx,inductor --calibrate "$cal/resnet.json" --steps 5 \
        --json "$out/resnet1.json"
      cp "$cal/resnet.json" "$out/calibration_resnet.json" 2>/dev/null  # the table the rows were planned with
      ;;
    schedlib)  # 2 GPUs (4 when present): the schedule library beside PyTorch's same-named schedules, then the dualpipev trace
      export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
      bench 400 2 29521 --budget 370 --families "$families" --calibrate "$cal" --one-gpu-layers 0 --timeout 240 \
        --compilers auto --schedules 1f1b,looped-bfs,interleaved-zb,zbv,dualpipev,auto \
        --torch-eager 1f1b,looped-bfs,interleaved-zb,zbv,dualpipev --torch-compiled 1f1b,looped-bfs \
        --torch-risky interleaved-zb,zbv,dualpipev \
        --risky-timeout 60 --out-dir "$out/schedlib"
      OUT="$out" timeout 120 torchrun --nproc_per_node 2 --master-port 29522 benchmarks/dualpipev_trace.py
      ;;
    *) echo "unknown part $part (two, one, stages, profile, examples, four, fourzbv, fourcopy, fourwhy, fourdata, fourhost, fourgraphs, fourcheck, fourdp, fourall, resnet, resnetwhy or schedlib)"; exit 2 ;;
  esac
  cp "$cal"/*.json "$out"/ 2>/dev/null
  [ -n "${pace_pid:-}" ] && kill "$pace_pid" 2>/dev/null
} 2>&1 | tee "$log" | grep -v -E "^\s+(torch|fnpipe) .*: step |^\[W|UserWarning|warnings.warn"
jsons=$(ls "$out"/bench_*.json "$out"/*/bench_*.json 2>/dev/null)
[ -n "$jsons" ] && python3 benchmarks/bench_report.py $jsons 2>&1 | tee "$out/tables_$part.txt"
