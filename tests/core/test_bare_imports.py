"""The core imports on a bare CPU box: with torch, transformers, numpy, ray, FastAPI, uvicorn,
megatron and safetensors unimportable, the CLI loads, a packaged recipe loads and validates
(every component's options included), and the installed plugins list. Heavy dependencies are
imported by the component that needs them, when it needs them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

HEAVY = ("torch", "transformers", "numpy", "ray", "fastapi", "uvicorn", "megatron", "safetensors")


def test_cli_recipes_and_plugins_need_no_heavy_dependency() -> None:
    code = textwrap.dedent(f"""
        import sys
        for name in {HEAVY!r}:
            sys.modules[name] = None  # any import of it fails
        from click.testing import CliRunner
        from miles_engine.cli.main import cli
        from miles_engine.config.recipe import load_recipe
        from miles_engine.hub import default_hub
        import miles_engine.checkpoint.compat, miles_engine.models.source, miles_engine.rollout.parts
        import miles_engine.run.policy, miles_engine.sft.loop
        cfg = load_recipe("tiny-terminal", ["trainer.algorithm.routing_replay=true"], hub=default_hub())
        assert cfg.session_server.record_routed_experts
        for args in (["recipes", "validate", "tiny-terminal"], ["plugins", "--json"], ["recipes", "ls"]):
            result = CliRunner().invoke(cli, args)
            assert result.exit_code == 0, (args, result.output, result.exception)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]
