from pathlib import Path


def test_count_file_exists():
    assert Path("/app/count.txt").is_file()


def test_count_is_right():
    words = Path("/app/text.txt").read_text().split()
    assert Path("/app/count.txt").read_text().strip() == str(len(words))
