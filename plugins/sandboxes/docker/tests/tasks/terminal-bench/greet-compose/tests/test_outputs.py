import os
from pathlib import Path


def test_built_from_the_client_service():
    assert Path("/etc/miles-fixture").read_text().strip() == "built-from-compose"


def test_greeting_from_the_compose_environment():
    assert os.environ["TEST_DIR"] == "/tests"
    assert Path("/app/greeting.txt").read_text().strip() == os.environ["GREETING"] == "hello from compose"
