"""verl's modules, imported once per session from .venv/oracles (tests/helpers/verl_oracle.py)."""
import pytest

from tests.helpers.verl_oracle import require


@pytest.fixture(scope="session")
def verl():
    core, corr = require()
    return core, corr
