"""A Harbor task directory, built through the registered ``harbor`` component, keeps the environment contract."""

from __future__ import annotations

import pytest
from harbor_testkit import make_task

from miles_engine.hub import Hub
from miles_engine.testing.environment import EnvironmentContract

# A second task, so listing, ids and loading are checked over more than one task.
COUNT_TEST_SH = """\
#!/bin/bash
if [ "$(cat /app/count.txt 2>/dev/null)" = "3" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
COUNT_SOLVE_SH = "#!/bin/bash\necho alpha beta gamma | wc -w | tr -d ' ' > /app/count.txt\n"


class TestHarborContract(EnvironmentContract):
    episode_timeout_s = 60.0

    @pytest.fixture
    def source(self, tmp_path):
        make_task(tmp_path, "answer")
        make_task(tmp_path, "count-words",
                  instruction="Write the number of words in 'alpha beta gamma' to /app/count.txt.\n",
                  test_sh=COUNT_TEST_SH, solve_sh=COUNT_SOLVE_SH)
        return Hub().create("environment", "harbor", {"path": str(tmp_path)})
