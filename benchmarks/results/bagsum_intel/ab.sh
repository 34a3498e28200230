#!/bin/bash
# Alternated before/after runs of cpu_throughput.py: $1 = tag, rest = its args; JSON in /tmp/ab
tag=$1; shift
for i in ${PAIRS:-1 2 3}; do
 for side in before after; do
  if [ $side = before ]; then d=/tmp/before; else d=/work/main; fi
  out=${OUT_DIR:-/tmp/ab}/${tag}_${side}_$i.json
  (cd $d && PYTHONPATH=$d /work/main/.venv/bin/python benchmarks/cpu_throughput.py "$@" --rounds 1 --out $out > ${OUT_DIR:-/tmp/ab}/${tag}_${side}_$i.log 2>&1)
  python3 -c "import json; d=json.load(open('$out')); r=d['results']; print('$tag $side $i', {k: (round(v['samples_per_s']), round(v.get('x_torchrec_paired') or 0,3)) for k, v in r.items()})"
 done
done
