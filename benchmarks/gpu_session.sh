#!/usr/bin/env bash
# Every GPU measurement the performance issue asks for, in one call of about 6 minutes on one H200.
#
#   bash benchmarks/device_wheels.sh            # here, once: wheels of the pure-Python deps (offline GPU box)
#   run(command="bash benchmarks/gpu_session.sh", carry=[".device-wheels"], timeout_s=540)
#
# The step limits add up to 480 s, inside that timeout, so a slow step never takes the later ones with it
# (60 + 85 + 170 + 70 + 80 + 15: step 0 took its 60 s from the others' first guesses, 100 + 200 + 80 + 80 + 20).
#
# Writes every table, JSON and log under $OUT (default runs/gpu_session); each step has its own time limit,
# so a failing or slow step leaves the others' results. QUICK=1 DEVICE=cpu runs the same steps on the `tiny`
# model in a minute or two (how this script is checked without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_session}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}  # H100/H200 dense bf16
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/.device-site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, record the exit status
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$OUT/steps.txt"
}

if [ -d .device-wheels ]; then
    python -m pip install -q --no-index --no-deps --target .device-site .device-wheels/*.whl > "$OUT/pip.log" 2>&1 \
        || echo "wheel install failed (see pip.log): the fit step will fail, the benchmarks do not need them"
fi
{
    date -u
    python -c "import sys, torch, lightning; print(sys.version.split()[0], 'torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.version.cuda)"
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv
    nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "$QUICK" = 1 ]; then
    MODEL=tiny; MUON_MODELS="tiny"; SEQ=128; BATCH=16; REPS=3; FIT_ARGS=(--trainer.max_steps 20 --trainer.val_check_interval 10 --trainer.enable_progress_bar false)
else
    MODEL=smollm2-135m; MUON_MODELS="small smollm2-135m smollm2-360m"; SEQ=2048; BATCH=16; REPS=10
    FIT_ARGS=(--trainer.max_steps 60 --trainer.val_check_interval 30 --trainer.precision bf16-mixed --trainer.enable_progress_bar false)
fi

# 0. Every code path of the runtime one device reaches, on it, against its reference rule: a one-stage pipeline
#    (plan_rank/build in a one-process NCCL group) under 2BW (weight versions and their swaps) with AdamW, fused AdamW,
#    bf16 autocast and compiled blocks, 1F1B with Muon, PipeDream, and WeightSwap itself; weights against the
#    reference, steps/s, memory_report() against torch.cuda.max_memory_allocated(). Exits 1 on any FAIL.
step one_gpu_paths 60 python benchmarks/one_gpu_paths.py --device "$DEVICE" --json "$OUT/one_gpu_paths.json"

# 1. Muon step: torch.optim.Muon vs BatchedMuon vs NorMuon vs fused AdamW (target: torch / Batched >= 5 at 135M).
step muon_speed 85 python benchmarks/muon_speed.py --device "$DEVICE" --models $MUON_MODELS --json "$OUT/muon_speed.json"

# 2. Tokens/s and MFU, sync and delayed + EF, eager vs compiled blocks, bf16 autocast (target: MFU >= 0.40).
step mfu_adamw 170 python benchmarks/compile_speed.py --device "$DEVICE" --models "$MODEL" --paths plain delayed-ef \
    --optimizer adamw --autocast bf16 --seq-len "$SEQ" --batch "$BATCH" --reps "$REPS" --warmup 2 \
    --peak-tflops "$PEAK_TFLOPS" --json "$OUT/mfu_adamw.json"
step mfu_muon 70 python benchmarks/compile_speed.py --device "$DEVICE" --models "$MODEL" --paths delayed-ef \
    --optimizer muon --autocast bf16 --seq-len "$SEQ" --batch "$BATCH" --reps "$REPS" --warmup 2 \
    --peak-tflops "$PEAK_TFLOPS" --json "$OUT/mfu_muon.json"

# 3. The real training path end to end on the GPU (Lightning, DelaySimulation + ErrorFeedback, Muon), on the
#    embedded corpus: that it runs, its tokens/s, and that the loss goes down. Byte tokenizer, so the embedding
#    is smaller than the 135M shape's; the MFU numbers above use the full vocabulary.
ACCEL=$([ "$DEVICE" = cuda ] && echo gpu || echo cpu)
step fit_delayed_ef 80 python -m lightning_async.cli fit --config recipes/quickstart.yaml \
    --config recipes/optimizers/muon.yaml --config recipes/modes/delayed-ef.yaml \
    --model.model "$MODEL" --trainer.accelerator "$ACCEL" --data.seq_len "$SEQ" --data.batch_size "$BATCH" \
    --trainer.logger.init_args.save_dir "$OUT/runs" "${FIT_ARGS[@]}"
step fit_summary 15 python - "$OUT/runs" <<'EOF'
import sys
from pathlib import Path
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

for events in sorted(Path(sys.argv[1]).rglob("events.out.tfevents.*")):
    acc = EventAccumulator(str(events)).Reload()
    for tag in ("train/loss", "val/loss", "train/tokens_per_sec"):
        if tag in acc.Tags()["scalars"]:
            values = [(e.step, round(e.value, 4)) for e in acc.Scalars(tag)]
            print(events.parent.name, tag, values[:2], "...", values[-2:])
EOF

# A device call brings back at most 8 files from $OUT (none deeper than $OUT/a/b/): pack every log, JSON and event
# file into session.tar.gz and leave beside it only the summaries and the results' JSON (7 files in all).
archive=$(mktemp)
tar -czf "$archive" -C "$OUT" --exclude=session.tar.gz . && mv "$archive" "$OUT/session.tar.gz" \
    && rm -rf "$OUT"/*.log "$OUT/runs"
echo "== summary (every log: $OUT/session.tar.gz)"
cat "$OUT/steps.txt"
python - "$OUT/one_gpu_paths.json" <<'PY' 2>/dev/null || echo "one_gpu_paths: no results"
import json, sys
r = json.load(open(sys.argv[1]))
print("one_gpu_paths on", r["device_name"], "model", r["model"], "in", round(r["seconds"], 1), "s")
for row in r["rows"]:
    print(f"  {row['path']:13} {row['status']:4} max|dw| {row.get('max_diff')} tol {row.get('tolerance')} "
          f"steps/s {row.get('steps_per_s')} report {row.get('accounted_bytes')} peak {row.get('peak_allocated_bytes')} "
          f"{'; '.join(row.get('notes') or [])}")
PY
echo "done: results under $OUT"
