import pytest

from ci import runner


@pytest.fixture(scope="session")
def matrix_build(tmp_path_factory):
    """Every entry's notebook executed once on its matrix, into a temporary build directory;
    shared by the notebook tests and the site tests."""
    build = tmp_path_factory.mktemp("build")
    results = {(r.entry, r.release, r.environment): r
               for r in runner.run_matrix(runner.matrix(), cell_timeout=300, build=build)}
    return build, results
