#!/usr/bin/env bash
# The GPU runs behind BENCHMARKS.md, in one call per part. Run from the repo root on an H200 machine:
#   bash benchmarks/h200_session.sh two       # 2 GPUs: NCCL equivalence, base and large GPT against PyTorch
#                                             # (fx and inductor-compiled stage programs)
#   bash benchmarks/h200_session.sh inductor  # 2 GPUs: only the inductor rows, against PyTorch 1F1B
#   bash benchmarks/h200_session.sh profile   # 1 GPU, then 2: one stage kernel by kernel, and inductor on base
#   bash benchmarks/h200_session.sh examples  # 2 GPUs: examples/train_gpt.py under torchrun and mpirun
#   bash benchmarks/h200_session.sh four      # 4 GPUs: NCCL equivalence, depth 4, then DP2 x PP2
#   bash benchmarks/h200_session.sh schedlib  # 2 GPUs: the schedule library beside PyTorch's same-named schedules,
#                                             # schedule="auto", and the dualpipev overlap trace (4 GPUs: P=4 too)
# Writes JSON and the log under $OUT (else out/); each step has its own time limit, so one hang does not
# take the others with it. The tables come last in the log.
set -uo pipefail
part=${1:?usage: h200_session.sh two|inductor|profile|examples|four|schedlib}
out=${OUT:-out}
cal=${CAL_DIR:-/tmp/fnpipe_cal}  # op timings, kept between the parts of one machine's session
mkdir -p "$out" "$cal"
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} OMP_NUM_THREADS=4
log="$out/log_$part.txt"
bench() { timeout "$1" torchrun --nproc_per_node "$2" --master-port "$3" benchmarks/gpu_pipeline.py "${@:4}"; }
{
  date -u; nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv; nvidia-smi topo -m
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
  case $part in
    two)  # at most 100 + 260 + 230 s: one call of the device tool
      export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
      timeout 100 mpirun --allow-run-as-root -n 2 python3 tests/mpi/equivalence.py > "$out/equivalence.txt" 2>&1
      echo "equivalence over NCCL, 2 ranks: exit $?, $(grep -c '^OK' "$out/equivalence.txt") OK lines"; tail -n 2 "$out/equivalence.txt"
      bench 260 2 29514 --calibrate "$cal/cal_base.json" --torch-schedules 1f1b,gpipe,zb-h1,zbv \
        --inductor 1f1b,zb-h1 --out "$out/bench_base.json"
      bench 230 2 29515 --large --calibrate "$cal/cal_large.json" --schedules 1f1b,zb-h1 --torch-schedules 1f1b \
        --inductor 1f1b,zb-h1 --no-one-gpu --out "$out/bench_large.json"
      ;;
    inductor)
      export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
      bench 330 2 29518 --calibrate "$cal/cal_base.json" --schedules "" --torch-schedules 1f1b --inductor 1f1b,zb-h1 \
        --no-one-gpu --out "$out/bench_base_inductor.json"
      bench 240 2 29519 --large --calibrate "$cal/cal_large.json" --schedules "" --torch-schedules 1f1b \
        --inductor zb-h1 --no-one-gpu --out "$out/bench_large_inductor.json"
      ;;
    profile)
      CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/profile_stage.py --calibrate "$cal/cal_base.json" \
        --variants fx,remat1,inductor --out "$out/profile.json"
      export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
      bench 330 2 29518 --calibrate "$cal/cal_base.json" --schedules "" --torch-schedules 1f1b --inductor 1f1b,zb-h1 \
        --no-one-gpu --out "$out/bench_base_inductor.json"
      ;;
    examples)
      export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
      timeout 200 torchrun --nproc_per_node 2 --master-port 29520 examples/train_gpt.py --steps 100 --schedule 1f1b \
        --log-every 20
      timeout 200 mpirun --allow-run-as-root -n 2 python3 examples/train_gpt.py --steps 100 --schedule zb-h1 \
        --log-every 20 --compiler inductor
      ;;
    four)
      timeout 150 mpirun --allow-run-as-root -n 4 python3 tests/mpi/equivalence.py > "$out/equivalence.txt" 2>&1
      echo "equivalence over NCCL, 4 ranks: exit $?, $(grep -c '^OK' "$out/equivalence.txt") OK lines"; tail -n 2 "$out/equivalence.txt"
      bench 240 4 29516 --calibrate "$cal/cal_base.json" --schedules gpipe,1f1b,interleaved-1f1b,zb-h1,zbv \
        --torch-schedules 1f1b,gpipe,interleaved-1f1b,zbv --out "$out/bench_p4.json"
      bench 180 4 29517 --dp 2 --calibrate "$cal/cal_base.json" --schedules 1f1b,zb-h1 --torch-schedules 1f1b,gpipe \
        --out "$out/bench_dp2.json"
      ;;
    schedlib)  # at most 240 + 120 (+ 240 with four GPUs) s
      gpus=$(nvidia-smi -L | wc -l)
      bench 240 2 29521 --calibrate "$cal/cal_base.json" --no-one-gpu \
        --schedules 1f1b,looped-bfs,interleaved-zb,zbv,dualpipev,auto \
        --torch-schedules 1f1b,looped-bfs,interleaved-zb,zbv,dualpipev --out "$out/bench_schedlib_p2.json"
      OUT="$out" timeout 120 torchrun --nproc_per_node 2 --master-port 29522 benchmarks/dualpipev_trace.py
      if [ "$gpus" -ge 4 ]; then
        bench 240 4 29523 --calibrate "$cal/cal_base.json" --no-one-gpu \
          --schedules 1f1b,looped-bfs,interleaved-zb,zbv,dualpipev,auto \
          --torch-schedules 1f1b,looped-bfs,interleaved-zb,zbv,dualpipev --out "$out/bench_schedlib_p4.json"
      fi
      ;;
    *) echo "unknown part $part (two, inductor, profile, examples, four or schedlib)"; exit 2 ;;
  esac
  cp "$cal"/*.json "$out"/ 2>/dev/null
} 2>&1 | tee "$log" | grep -v -E "^\s+(torch|fnpipe) .*: step |^\[W|UserWarning|warnings.warn"
ls "$out"/bench_*.json > /dev/null 2>&1 && python3 benchmarks/bench_report.py "$out"/bench_*.json 2>&1 | tee "$out/tables_$part.txt"
