"""Fixtures shared by the alignment tests.

python -m pytest tests/alignment -q
"""

import pytest


@pytest.fixture(scope="session")
def offline_run(tmp_path_factory):
    """One small real training run logged to W&B offline, read back (``test_telemetry.offline_run``); shared by the
    telemetry and dashboard tests so that it runs once."""
    import torch

    from tests.alignment.test_telemetry import offline_run as run

    # a session fixture is set up before the function-scoped seed (tests/conftest.py): without its own, the run's
    # models would start from whatever random state the tests before it left
    torch.manual_seed(0)
    return run(tmp_path_factory.mktemp("offline_run"))
