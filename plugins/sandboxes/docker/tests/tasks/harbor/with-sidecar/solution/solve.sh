#!/bin/bash
python3 -c "import urllib.request; print(urllib.request.urlopen('http://cache:8080/answer', timeout=45).read().decode().strip())" > /app/answer.txt
