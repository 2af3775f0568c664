"""The harness's pool of jobs: which cases it takes, a case's own variables reach every rank, and no later case
sees them."""
from __future__ import annotations

import json

import pytest

from tests.mpi_harness import pool_takes, run_case

CASE = "tests.cases.harness_cases:case_environment"


def test_a_pooled_case_sees_its_variables_and_the_next_case_does_not():
    names = {"PYHIPA2A_PUSH_MAX_TOKENS": "7", "PYHIPA2A_PUBLISH": "system"}
    run_case(CASE, 2, "host", args=(json.dumps(names),), env=names)
    run_case(CASE, 2, "host", args=(json.dumps(dict.fromkeys(names)),))
    publish = {"PYHIPA2A_PUBLISH": "gpu-fence"}
    run_case(CASE, 2, "host", args=(json.dumps(publish),), env=publish)


@pytest.mark.parametrize("setting,host,gpu", [(None, True, False), ("gpu", True, True), ("0", False, False)])
def test_the_pool_takes_host_cases_and_gpu_cases_only_when_asked(monkeypatch, setting, host, gpu):
    if setting is None:
        monkeypatch.delenv("PYHIPA2A_TEST_POOL", raising=False)
    else:
        monkeypatch.setenv("PYHIPA2A_TEST_POOL", setting)
    assert (pool_takes("host"), pool_takes("cuda"), pool_takes("hip"), pool_takes(None)) == (host, gpu, gpu, False)


def test_an_unknown_pool_setting_is_refused(monkeypatch):
    monkeypatch.setenv("PYHIPA2A_TEST_POOL", "yes")
    with pytest.raises(ValueError, match="PYHIPA2A_TEST_POOL='yes'"):
        pool_takes("host")
