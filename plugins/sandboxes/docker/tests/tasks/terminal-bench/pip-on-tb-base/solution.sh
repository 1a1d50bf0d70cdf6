#!/bin/bash
python -c 'import greeter; print(greeter.greet("bench"))' > /app/greeting.txt
