"""``miles serve`` end to end: a config.json model served in a subprocess, driven by the client."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from miles_engine.cli.main import cli
from miles_engine.engines.http.client import HttpEngine
from miles_engine.engines.launch import ServerProcess
from miles_engine.engines.protocol import GenerateRequest, SamplingParams

REPO = Path(__file__).resolve().parents[3]


def test_serve_help_lists_the_options() -> None:
    out = CliRunner().invoke(cli, ["serve", "--help"])
    assert out.exit_code == 0
    for opt in ("--model", "--port", "--host", "--dtype", "--threads"):
        assert opt in out.output


@pytest.mark.timeout(90)
def test_miles_serve_a_config_json(tmp_path: Path) -> None:
    config = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
              "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = [sys.executable, "-m", "miles_engine.cli.main", "serve", "--model", str(tmp_path / "config.json"),
            "--port", "0", "--port-file", str(tmp_path / "port"), "--threads", "1", "--dtype", "float32"]

    async def main() -> None:
        proc = ServerProcess(argv, port_file=tmp_path / "port", cwd=REPO, name="miles-serve",
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        await proc.start(75)
        client = HttpEngine(proc.url)
        try:
            await client.connect()
            assert client.is_miles_server and client.weight_version == 0
            res = await client.generate(GenerateRequest([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=6)))
            assert 1 <= len(res.output_ids) <= 6 and res.weight_versions == [0] * len(res.output_ids)
            with pytest.raises(ValueError, match="vocabulary"):
                await client.generate(GenerateRequest([300]))
            info = client.server_info
            assert info["model_path"].endswith("config.json")
        finally:
            await client.aclose()
            code = await proc.stop(grace_s=10)
        assert code == 0, proc.log_tail()
        assert "miles-engine serving" in proc.log_tail()
    asyncio.run(main())
