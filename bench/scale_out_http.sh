#!/bin/bash
# End to end through HTTP: `tokenhaul serve --replicas 2` (cache_aware, then round_robin) and `tokenhaul bench serve`
# on 48 prompts sharing 4 system prompts of 512 tokens, KV 96 blocks per replica (as bench/scale_out.py).
# Run: flock -x /tmp/tokenhaul-bench.lock bench/scale_out_http.sh   (about 1.5 min; .venv with the `ray` extra)
set -e
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DIR=$(mktemp -d)
$PY - "$DIR/shared_prefix.jsonl" <<'PYEOF'
import json, random, sys
from tokenhaul.bench.loadgen import _WORDS
rng = random.Random(0)
prefixes = [f"System {g}: " + " ".join(rng.choice(_WORDS) for _ in range(480)) for g in range(4)]
order = [i % 4 for i in range(48)]
rng.shuffle(order)
with open(sys.argv[1], "w") as f:
    for i, g in enumerate(order):
        question = " ".join(rng.choice(_WORDS) for _ in range(24))
        f.write(json.dumps({"prompt": prefixes[g] + f" Question {i}: " + question, "max_tokens": 16}) + "\n")
PYEOF
for routing in cache_aware round_robin; do
  port=$((18000 + RANDOM % 1000))
  $PY -m tokenhaul.cli serve --model smollm2-135m --replicas 2 --threads 1 --num-kv-blocks 96 --max-model-len 2048 \
      --routing $routing --port $port --log-level warning > "$DIR/serve-$routing.log" 2>&1 &
  server=$!
  for _ in $(seq 1 180); do curl -sf "127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  echo "== routing $routing"
  $PY -m tokenhaul.cli bench serve --url "http://127.0.0.1:$port" --dataset "$DIR/shared_prefix.jsonl" \
      --num-requests 48 --concurrency 6 --output-len 16
  kill -TERM $server
  wait $server
done
