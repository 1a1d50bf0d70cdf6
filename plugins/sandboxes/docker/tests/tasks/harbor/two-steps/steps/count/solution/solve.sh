#!/bin/bash
wc -l < /app/numbers.txt | tr -d " " > /app/count.txt
