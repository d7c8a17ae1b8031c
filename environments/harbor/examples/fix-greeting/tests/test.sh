#!/bin/bash
python3 -c "import sys; sys.path.insert(0, '/app'); from greet import greet; assert greet('Ada') == 'Hello, Ada!' and greet('') == 'Hello, !'"
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
