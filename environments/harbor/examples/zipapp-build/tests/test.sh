#!/bin/bash
cd /app && rm -rf dist && mkdir dist && ./build.sh && [ "$(python3 dist/calc.pyz 2 3)" = 5 ]
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
