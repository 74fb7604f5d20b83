import jax
import pytest


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(sub, "eqns"):
                    yield from _all_eqns(sub)
                elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from _all_eqns(sub.jaxpr)


@pytest.fixture
def jaxpr_eqns():
    """(f, *args) -> every equation of f's jaxpr, those inside loops, jit and custom rules included."""
    return lambda f, *args: list(_all_eqns(jax.make_jaxpr(f)(*args).jaxpr))


@pytest.fixture(scope="session")
def http_artifacts(tmp_path_factory):
    """(text artifact, ids artifact) that the HTTP tests serve (tests/http_util.py), exported once per session."""
    from http_util import export_http_artifacts
    return export_http_artifacts(tmp_path_factory.mktemp("http-artifacts"))


@pytest.fixture(scope="session")
def serve_cache_dir(tmp_path_factory):
    """A compiled-executable cache shared by the in-process serving tests."""
    return tmp_path_factory.mktemp("serve-executables")
