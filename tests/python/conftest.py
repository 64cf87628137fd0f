"""pytest's entry point for tests/python: the shared fixtures. The helpers the tests import
(paths, running the binary, nodes, the server, cgroup caps, comparisons, namespaces) are in
support/; markers and options are in pytest.ini at the repository's root."""

import pytest

from support.paths import ringllm_bin


@pytest.fixture(scope="session")
def ringllm():
    """The ringllm binary under test (RINGLLM_BIN, else target/ci/ringllm)."""
    return ringllm_bin()
