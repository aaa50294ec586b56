#!/bin/bash
# A/B of the pipeline runtime across source trees in one session: each tree's own
# benchmarks/pipeline_throughput.py, the trees alternated ROUNDS times, torch's 1F1B the control in every run
# (ratios to it compare across trees; absolute times drift with the machine's load).
#   git worktree add --detach /tmp/ab-8e24f01 8e24f01
#   ROUNDS=2 benchmarks/ab_trees.sh /tmp/ab-8e24f01 "$PWD"
# Extra arguments for the benchmark go in BENCH_ARGS (default: p = 4, m = 8 sleep stages at 20 ms).
set -u
ROUNDS=${ROUNDS:-2}
BENCH_ARGS=${BENCH_ARGS:-"--configs sleep:4:8 --schedules torch-1F1B,1f1b,2bw,2bw-split --rounds 1"}
for round in $(seq 1 "$ROUNDS"); do
  for tree in "$@"; do
    echo "== $tree round $round $(git -C "$tree" log --oneline -1 | cut -c1-70)"
    (cd "$tree" && PYTHONPATH="$tree" python benchmarks/pipeline_throughput.py $BENCH_ARGS 2>&1 | grep "^| sleep")
  done
done
