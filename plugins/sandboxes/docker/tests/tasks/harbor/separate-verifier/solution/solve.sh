#!/bin/bash
sha256sum /app/input.bin > /app/scratch.txt
cut -d' ' -f1 /app/scratch.txt > /app/result.txt
