#!/bin/bash
# Alternated before/after pairs of gpu.py on the CPU: $1 = tag, rest = gpu.py args; results in $OUT_DIR (default: here)
tag=$1; shift
for i in ${PAIRS:-1 2 3 4}; do
 for side in before after; do
  if [ $side = before ]; then d=/tmp/before; else d=/work/main; fi
  out=${OUT_DIR:-/work/main/benchmarks/results/plain_stacked_intel}/${tag}_${side}_$i.json
  (cd $d && PYTHONPATH=$d /work/main/.venv/bin/python benchmarks/gpu.py "$@" --out $out > /tmp/ab_${tag}_${side}_$i.log 2>&1)
  python3 -c "import json; d=json.load(open('$out')); print('$tag $side $i', {k: round(r['samples_per_s']) for k, r in d['results'].items()})"
 done
done
