#!/bin/bash
# terminal-bench runs this with TEST_DIR=/tests after the agent is done.
cd "$TEST_DIR" && python3 -m pytest -rA test_outputs.py
