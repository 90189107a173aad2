#!/bin/bash
# The bursty part of `sits bench engine` on two checkouts of SITS, runs alternating (old, new, new,
# old), each from `/` so that PYTHONPATH picks the checkout:
#   git worktree add /tmp/old <commit>; bench/bursty_code_ab.sh /tmp/old "$PWD" MODEL_DIR bfloat16
# JSON per run in /tmp/bursty_{old,new}_{1,2}.json; progress lines on stdout.
set -e
OLD=$1 NEW=$2 MODEL=$(realpath "$3") DTYPE=${4:-float32}
PY="$(cd "$NEW" && pwd)/.venv/bin/python"   # not realpath: the link must keep the venv
cd /
for r in 1 2; do
  for c in old new; do
    if [ "$r" = 2 ]; then c=$([ "$c" = old ] && echo new || echo old); fi
    src=$([ "$c" = old ] && echo "$OLD" || echo "$NEW")
    PYTHONPATH=$src "$PY" -c "import sys; from sits.cli import main; sys.exit(main())" bench engine \
      --model "$MODEL" --dtype "$DTYPE" --repeats 1 --only bursty --json "/tmp/bursty_${c}_$r.json" 2>&1 \
      | grep "ttft_p50 " | sed "s/^/$c run $r: /"
  done
done
