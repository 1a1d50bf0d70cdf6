#!/bin/bash
python3 -c "import urllib.request; print(urllib.request.urlopen('http://cache:8080/answer').read().decode().strip())" > /app/answer.txt
