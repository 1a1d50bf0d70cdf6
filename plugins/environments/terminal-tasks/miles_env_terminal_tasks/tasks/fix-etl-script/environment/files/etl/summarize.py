#!/usr/bin/env python3
"""Summarise orders: python3 summarize.py ORDERS.jsonl SUMMARY.json

Each input line is a JSON object {"customer": str, "amount": str|number, "status": str}.
Blank lines are ignored. Orders whose status is "cancelled" are left out. The output is a
JSON object mapping each customer to {"orders": int, "total": float rounded to 2 places},
with customers in alphabetical order.
"""
import json
import sys


def summarize(lines):
    out = {}
    for line in lines:
        order = json.loads(line)
        if order["status"] == "canceled":
            continue
        entry = out.setdefault(order["customer"], {"orders": 0, "total": 0})
        entry["orders"] += 1
        entry["total"] += int(float(order["amount"]))
    return out


def main(argv):
    src, dst = argv[1], argv[2]
    with open(src) as f:
        summary = summarize(f)
    with open(dst, "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main(sys.argv)
