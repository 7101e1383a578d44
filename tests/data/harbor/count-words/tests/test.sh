#!/bin/bash
# partial credit: the share of the hidden cases counted right, in reward.json
mkdir -p /logs/verifier
passed=0
total=0
for case in /tests/cases/*.txt; do
  total=$((total + 1))
  expected=$(cat "${case%.txt}.expected")
  got=$(python3 /workspace/src/words.py "$case" 2>/dev/null)
  [ "$got" = "$expected" ] && passed=$((passed + 1))
done
python3 -c "import json; print(json.dumps({'reward': $passed / $total, 'passed': $passed, 'total': $total}))" \
  > /logs/verifier/reward.json
