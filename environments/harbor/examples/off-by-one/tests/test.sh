#!/bin/bash
cd /app && python3 -c "from mathlib.series import total; assert [total(n) for n in (0, 1, 4, 10)] == [0, 1, 10, 55]"
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
