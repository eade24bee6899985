"""One `make serve` server for every README and docs example (package scope), and the state they build.

The docs are a narrative: later blocks use what earlier ones made (the `client` of the quickstart's
python block, the adapter uploaded, the session, the tenants and keys created). Each such step is a
fixture that runs its block once, so any test can ask for it and the tests pass in any order or alone.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from make_serve import MakeServe, newcomer_env, prepare_checkout
from readme_examples import Example, PythonRun, named, run_python


@pytest.fixture
def example(request: pytest.FixtureRequest) -> Example:
    """The README or docs block named by the test's `@readme_example(...)`."""
    marker = request.node.get_closest_marker("readme_example")
    if marker is None:
        raise RuntimeError(f"{request.node.name} uses `example` without @readme_example(name)")
    return named(marker.args[0])


@pytest.fixture(scope="package")
def make_serve(tmp_path_factory: pytest.TempPathFactory, trained_adapters: dict[str, Path]) -> Iterator[MakeServe]:
    workdir = prepare_checkout(tmp_path_factory.mktemp("checkout"))
    # the docs upload `pirate/...` from the directory they are run in: the PEFT adapter our fixtures train
    shutil.copytree(trained_adapters["pirate"], workdir / "pirate")
    server = MakeServe(workdir).start()
    try:
        yield server
    finally:
        server.stop()
        print(f"\n----- make serve log ({server.log_path}) -----\n{server.log()[-3000:]}", file=sys.stderr)


@pytest.fixture(scope="package")
def trained_adapters(smollm_path: Path) -> dict[str, Path]:
    from train_adapters import ensure_trained_adapters

    return ensure_trained_adapters(smollm_path)


@pytest.fixture(scope="package")
def placeholders(make_serve: MakeServe) -> dict[str, str]:
    """What the examples' placeholders stand for; later steps add ids (`key_...`, `adp_...`, `sess_...`)."""
    return {"lpx_...": make_serve.key, "127.0.0.1:8000": f"127.0.0.1:{make_serve.port}"}


@pytest.fixture(scope="package")
def shell_env(make_serve: MakeServe) -> dict[str, str]:
    return newcomer_env()


@pytest.fixture(scope="package")
def calling_run(make_serve: MakeServe, placeholders: dict[str, str]) -> PythonRun:
    """The quickstart's python block (it defines `client`, which the later blocks use)."""
    return run_python(named("calling-python"), placeholders, cwd=make_serve.workdir)


@pytest.fixture(scope="package")
def adapters_run(make_serve: MakeServe, placeholders: dict[str, str], calling_run: PythonRun) -> PythonRun:
    """The adapters page's upload, in the namespace the quickstart's block left."""
    run = run_python(named("adapters-python"), placeholders, namespace=calling_run.namespace, cwd=make_serve.workdir)
    placeholders["adp_..."] = run.namespace["adapter"]["id"]
    return run


@pytest.fixture(scope="package")
def sessions_run(make_serve: MakeServe, placeholders: dict[str, str], calling_run: PythonRun) -> PythonRun:
    """The sessions block: `session` (and `sess_...`) for the usage examples."""
    run = run_python(named("sessions-python"), placeholders, namespace=calling_run.namespace, cwd=make_serve.workdir)
    placeholders["sess_..."] = run.namespace["session"]["id"]
    return run


@pytest.fixture(scope="package")
def usage_run(make_serve: MakeServe, placeholders: dict[str, str], sessions_run: PythonRun) -> PythonRun:
    """The billing page's usage block, which reads what the session's turns cost."""
    return run_python(named("usage-python"), placeholders, namespace=sessions_run.namespace, cwd=make_serve.workdir)
