import shutil
from pathlib import Path


def test_greeting_comes_from_the_installed_package():
    assert Path("/app/greeting.txt").read_text().strip() == "hello, bench"


def test_the_base_carries_what_terminal_bench_bases_do():
    assert shutil.which("tmux") and shutil.which("asciinema") and shutil.which("pip")
    assert Path("/opt/venv/bin/python").exists()
