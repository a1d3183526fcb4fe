#!/bin/bash
tail -n +2 /app/data/sales.csv | cut -d, -f3 | paste -sd+ | bc > /app/out/total.txt 2>/dev/null \
  || python3 -c "import csv; print(sum(int(r['amount']) for r in csv.DictReader(open('/app/data/sales.csv'))))" > /app/out/total.txt
