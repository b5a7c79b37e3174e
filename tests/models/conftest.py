"""Fixtures for tests/models; helpers live in models_testlib."""
import pytest

import models_testlib  # noqa: F401  (puts the repo root on sys.path)


@pytest.fixture(scope='session')
def cpu_fallbacks():
    from flame.models.cpu import enable_cpu_fallbacks
    enable_cpu_fallbacks()
    return True
