import urllib.request
from pathlib import Path


def test_token_saved():
    assert Path("/app/token.txt").read_text().strip() == "sidecar-token-5f1c"


def test_server_still_reachable_by_name():
    assert urllib.request.urlopen("http://server:8000/token.txt", timeout=10).read().strip() == b"sidecar-token-5f1c"
