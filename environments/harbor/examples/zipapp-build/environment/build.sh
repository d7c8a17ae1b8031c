#!/bin/sh
set -e
python3 -m zipapp src -o dist/calc.pyz -m calc:mian
