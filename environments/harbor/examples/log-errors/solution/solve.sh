#!/bin/bash
cat /app/logs/*.log | awk '$2 == "ERROR" {print $3}' | sort | uniq -c \
  | awk '{print $2, $1}' | sort -k2,2nr -k1,1 > /app/report/errors.txt
