#!/bin/bash
cp /tests/test_hidden.py /app/tests/ 2>/dev/null
cd /app && if python3 -m unittest discover -s tests > /logs/verifier/unittest.txt 2>&1; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
