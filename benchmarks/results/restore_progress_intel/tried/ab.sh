#!/bin/bash
# usage: ab.sh ROUNDS "ENV=val strategy" ...
cd /tmp/exp
R=$1; shift
jobs=("$@")
for r in $(seq $R); do
  for job in "${jobs[@]}"; do
    envs="${job%%|*}"; strat="${job##*|}"
    out=$(env $envs PYTHONPATH=/tmp/exp /work/main/.venv/bin/python benchmarks/cpu_throughput.py --job $strat --steps 520 --warmup 240 2>/tmp/probe/last_err | tail -1)
    echo "$r $envs $strat $(echo "$out" | python -c "import json,sys; d=json.loads(sys.stdin.read()); print(round(d['samples_per_s']), round(d['hit_rate'] or 0,4))" 2>/dev/null || tail -3 /tmp/probe/last_err)"
  done
done
