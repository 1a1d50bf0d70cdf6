"""terminal-bench task directories, built through the registered ``terminal-bench`` component, keep the environment contract.

The tasks' run-tests.sh runs real pytest the way the end-to-end tests do: the sandbox's
/usr/bin/python3 with this environment's (pure-Python) pytest on PYTHONPATH.
"""

from __future__ import annotations

import asyncio
import shlex
from pathlib import Path

import pytest
from tb_testkit import make_tb_task

from miles_engine.hub import Hub
from miles_engine.testing.environment import EnvironmentContract
from miles_env_terminal_bench import load_tb_task

SITE = str(Path(pytest.__file__).resolve().parent.parent)
SANDBOX_PYTHON = "/usr/bin/python3"
RUN_TESTS = (f"#!/bin/bash\ncd /app\nPYTHONPATH={shlex.quote(SITE)} {SANDBOX_PYTHON} -m pytest -p no:cacheprovider -rA "
             '"$TEST_DIR/test_outputs.py"\n')
COUNT_TESTS = """\
from pathlib import Path


def test_count():
    assert Path("/app/count.txt").read_text().strip() == "3"
"""
COUNT_SOLUTION = "#!/bin/bash\necho alpha beta gamma | wc -w | tr -d ' ' > /app/count.txt\n"
COUNT_YAML = """\
instruction: |
  Write the number of words in 'alpha beta gamma' to /app/count.txt.
difficulty: easy
category: file-operations
parser_name: pytest
max_agent_timeout_sec: 30
max_test_timeout_sec: 20
"""


class TestTerminalBenchContract(EnvironmentContract):
    episode_timeout_s = 60.0

    @pytest.fixture
    def source(self, tmp_path):
        make_tb_task(tmp_path, "answer", run_tests=RUN_TESTS)
        make_tb_task(tmp_path, "count-words", task_yaml=COUNT_YAML, run_tests=RUN_TESTS,
                     tests={"test_outputs.py": COUNT_TESTS}, solution_sh=COUNT_SOLUTION)
        return Hub().create("environment", "terminal-bench", {"path": str(tmp_path)})

    @pytest.fixture
    def sandbox_backend(self, tmp_path_factory):
        """The local backend, once it is known to run pytest inside the sandbox (skipped, saying why, if not)."""
        backend = Hub().create("sandbox", "local")
        try:
            spec = load_tb_task(make_tb_task(tmp_path_factory.mktemp("probe"))).sandbox_spec()

            async def probe():
                async with await backend.create(spec) as sandbox:
                    return await sandbox.exec(f"PYTHONPATH={shlex.quote(SITE)} {SANDBOX_PYTHON} -c 'import pytest'",
                                              timeout_s=60)

            if spec is not None and backend.capabilities().absolute_paths:
                result = asyncio.run(probe())
                if not result.ok:
                    pytest.skip(f"{SANDBOX_PYTHON} cannot import pytest from {SITE} inside the sandbox: "
                                f"{result.stderr.strip()[-300:]}")
            yield backend
        finally:
            asyncio.run(backend.aclose())
