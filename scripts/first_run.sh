#!/usr/bin/env bash
# The newcomer's first run, measured: clone this repository into a fresh folder, `./run serve` there
# with empty pip and neuron caches, and time it until /health answers 200; then the venv's size.
#
#   scripts/first_run.sh [PORT]      # prints the run script's step lines, the time and `du -sh .venv`
#
# The clone is of the committed tree (HEAD). It is left in /tmp for a look; remove it afterwards.
set -euo pipefail
source_tree=$(cd "$(dirname "$0")/.." && pwd)
port=${1:-8765}
dir=$(mktemp -d /tmp/neuron-first-run.XXXXXX)
git clone -q "$source_tree" "$dir/neuron"
cd "$dir/neuron"
unset VENV_DIR
export NEURON_CACHE_DIR="$dir/neuron-cache" PIP_CACHE_DIR="$dir/pip-cache"  # nothing built or downloaded before

now_ms() { date +%s%3N; }
started=$(now_ms)
./run serve --port "$port" > "$dir/serve.log" 2>&1 &
server=$!
until curl -sf -o /dev/null "http://127.0.0.1:$port/health"; do
    if ! kill -0 "$server" 2>/dev/null; then
        tail -n 30 "$dir/serve.log"
        echo "first_run: ./run serve exited before /health answered 200 (log: $dir/serve.log)" >&2
        exit 1
    fi
    sleep 0.2
done
elapsed_ms=$(( $(now_ms) - started ))
kill -TERM "$server"
wait "$server" || true
grep '^run: ' "$dir/serve.log" || true
echo "fresh clone to /health 200: $((elapsed_ms / 1000)).$(( (elapsed_ms % 1000) / 100 )) s ($(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg))"
echo "venv: $(du -sh .venv | cut -f1) ($dir/neuron/.venv)"
