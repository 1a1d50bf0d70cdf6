#!/bin/bash
cd "$TEST_DIR" && python3 -m pytest -rA test_outputs.py
