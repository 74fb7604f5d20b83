import os
import shutil

import pytest

# skip_policy: a skipped test fails the run (but for modules another make target runs); pytester: its own test;
# time_breakdown (TLALOC_TIME_BREAKDOWN=1): where the run's time went, per file.
pytest_plugins = ["skip_policy", "pytester"] + (["time_breakdown"] if os.environ.get("TLALOC_TIME_BREAKDOWN") == "1"
                                                else [])


def pytest_configure(config):
    """TLALOC_ONE_CORE=1 (`make test-isa`'s one-core setting): every process that runs tests must be pinned to one
    core, or the setting would silently compute as the others do. pytest-xdist's controller runs no test."""
    if os.environ.get("TLALOC_ONE_CORE") != "1":
        return
    controller = not os.environ.get("PYTEST_XDIST_WORKER") and (config.getoption("numprocesses", None)
                                                                or config.getoption("tx", None))
    cores = sorted(os.sched_getaffinity(0))
    if not controller and len(cores) != 1:
        raise pytest.UsageError(f"TLALOC_ONE_CORE=1, but this pytest process may run on cores {cores}: start it "
                                "under `taskset -c N` (make test-isa starts each pytest-xdist worker so)")


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
    import jax          # here, not at the top: the model-free tests (tests/unit) import no JAX
    return lambda f, *args: list(_all_eqns(jax.make_jaxpr(f)(*args).jaxpr))


@pytest.fixture(scope="module", autouse=True)
def _every_draft_runs(request):
    """In a module marked every_draft, every draft the proposer makes runs: what those tests check is what drafting
    changes (ids, distributions, state), at any batch, where CallPlanner.drafts_that_pay would leave out the drafts
    that do not pay for their verify rows (tests/serving/test_paying_drafts.py tests that)."""
    if request.node.get_closest_marker("every_draft") is None:
        yield
        return
    from tlaloc_jax.serve.core.call_plan import CallPlanner
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CallPlanner, "drafts_that_pay", lambda self, decoding, drafted, ride=None: [w for w, _ in drafted])
        yield


def _run_folder(tmp_path_factory, name: str):
    """Under pytest-xdist, the path `name` that every worker of the run finds (their base temp folders share the
    run's parent); None in a run without workers."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    return tmp_path_factory.getbasetemp().parent / name


@pytest.fixture(scope="session")
def http_artifacts(tmp_path_factory):
    """(text artifact, ids artifact) that the HTTP tests serve (tests/support/http_util.py), exported once per run:
    under pytest-xdist the first worker to ask exports them where the others find them (the tests only read them,
    or copy them to change them)."""
    from http_util import export_http_artifacts
    root = _run_folder(tmp_path_factory, "http-artifacts")
    if root is None:
        return export_http_artifacts(tmp_path_factory.mktemp("http-artifacts"))
    from filelock import FileLock
    with FileLock(f"{root}.lock"):
        if not (root / "exported").is_file():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            export_http_artifacts(root)
            (root / "exported").touch()
    return root / "text", root / "ids"


@pytest.fixture(scope="session")
def serve_cache_dir(tmp_path_factory):
    """A compiled-executable cache shared by the serving tests of the run, across pytest-xdist's workers too: the
    same tiny models' bodies are compiled once, not once a module and worker (the cache writes atomically). Tests
    that check compiling itself take a directory of their own."""
    path = _run_folder(tmp_path_factory, "serve-executables")
    if path is None:
        return tmp_path_factory.mktemp("serve-executables")
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="module")
def http_engine(http_artifacts, serve_cache_dir):
    """The Engine on the HTTP tests' text artifact, loaded once per module; one app at a time drives it."""
    from http_util import loaded
    with loaded(http_artifacts[0], serve_cache_dir) as engine:
        yield engine


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its tolerance records to the controller, which reports them (below)."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        import dataclasses

        from margins import NEAR_TIES, RECORDS
        # execnet sends plain Python values only (numpy scalars become floats and ints).
        out["tolerance_records"] = [[float(ratio), str(what), float(err), float(bound)]
                                    for ratio, what, err, bound in RECORDS]
        out["near_ties"] = [{k: v.item() if hasattr(v, "item") else v for k, v in dataclasses.asdict(t).items()}
                            for t in NEAR_TIES]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist: a worker's tolerance records join the controller's."""
    from margins import NEAR_TIES, RECORDS
    from oracle import NearTie
    out = getattr(node, "workeroutput", {})
    RECORDS.extend(tuple(r) for r in out.get("tolerance_records", ()))
    NEAR_TIES.extend(NearTie(**t) for t in out.get("near_ties", ()))


def pytest_terminal_summary(terminalreporter):
    """With TLALOC_TOLERANCE_REPORT=1: the checks that came closest to their tolerance-model bounds."""

    from margins import NEAR_TIES, RECORDS
    if os.environ.get("TLALOC_TOLERANCE_REPORT") != "1" or not RECORDS:
        return
    # A control's check is meant to fail (its test expects the AssertionError): listed apart, over its bound.
    controls = [r for r in RECORDS if r[1].startswith("control")]
    checks = [r for r in RECORDS if not r[1].startswith("control")]
    terminalreporter.section("tolerance margins (measured / bound, closest first)")
    for ratio, what, err, bound in sorted(checks, reverse=True)[:25]:
        terminalreporter.write_line(f"{ratio:8.3f}  {err:10.3g} of {bound:10.3g}  {what}")
    if checks:
        terminalreporter.write_line(f"{len(checks)} checks; the largest ratio is {max(r[0] for r in checks):.3f}")
    if controls:
        terminalreporter.write_line(f"{len(controls)} controls recorded (each must exceed its bound); the smallest "
                                    f"ratio is {min(r[0] for r in controls):.3f}")
    terminalreporter.write_line(f"greedy ids that parted from an oracle's at a near-tie: {len(NEAR_TIES)}")
    for t in NEAR_TIES:
        terminalreporter.write_line(f"  step {t.step}: got {t.got_id}, oracle {t.oracle_id}, oracle margin "
                                    f"{t.gap:.3g} (allowed {t.allowed:.3g})")
