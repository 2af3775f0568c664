"""The harness's pool of jobs: a case's own variables reach every rank, and no later case sees them."""
from __future__ import annotations

import json

from tests.mpi_harness import run_case

CASE = "tests.cases.harness_cases:case_environment"


def test_a_pooled_case_sees_its_variables_and_the_next_case_does_not():
    names = {"PYHIPA2A_PUSH_MAX_TOKENS": "7", "PYHIPA2A_PUBLISH": "system"}
    run_case(CASE, 2, "host", args=(json.dumps(names),), env=names)
    run_case(CASE, 2, "host", args=(json.dumps(dict.fromkeys(names)),))
    publish = {"PYHIPA2A_PUBLISH": "gpu-fence"}
    run_case(CASE, 2, "host", args=(json.dumps(publish),), env=publish)
