#!/bin/bash
# Harbor's verifier contract: the reward goes to /logs/verifier/reward.txt. The verdict is written last, whatever
# the code under test wrote there while the tests ran.
mkdir -p /logs/verifier
python3 -m pytest -q -p no:cacheprovider /tests/hidden_calc.py
if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
