#!/bin/bash
echo "use awk" > /app/hint.txt
