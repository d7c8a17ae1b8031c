#!/bin/bash
sed -i 's/calc:mian/calc:main/' /app/build.sh
