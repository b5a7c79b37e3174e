import pytest
from flame_data_testlib import tokenizer


@pytest.fixture(scope="module")
def tok():
    """The bundled tokenizer, loaded once per test module."""
    return tokenizer()
