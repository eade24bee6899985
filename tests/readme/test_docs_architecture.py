"""The architecture page's diagrams name real parts: the domains' import graph is the code's, and every
class or file a diagram names exists."""

from __future__ import annotations

import re

from readme_examples import REPO_ROOT, Example, readme_example

DOMAINS = ("platform", "engine", "adapters", "grammar", "sessions", "billing")


def import_graph() -> set[tuple[str, str]]:
    """(a, b) for every domain a whose code imports domain b."""
    edges = set()
    for domain in DOMAINS:
        for path in (REPO_ROOT / domain).rglob("*.py"):
            for other in re.findall(r"^\s*(?:from|import) loraplex\.(\w+)", path.read_text(), re.M):
                if other != domain and other in DOMAINS:
                    edges.add((domain, other))
    return edges


def class_defined(name: str) -> bool:
    pattern = re.compile(rf"^class {name}\b", re.M)
    return any(pattern.search(p.read_text()) for d in DOMAINS for p in (REPO_ROOT / d).rglob("*.py"))


@readme_example("architecture-domains")
def test_domain_diagram_is_the_import_graph(example: Example) -> None:
    assert example.lang == "mermaid"
    drawn = set(re.findall(r"^\s*(\w+) --> (\w+)\s*$", example.text, re.M))
    assert drawn == import_graph(), (f"drawn but not imported: {sorted(drawn - import_graph())}; "
                                     f"imported but not drawn: {sorted(import_graph() - drawn)}")
    assert not any(b == "platform" for _, b in drawn), "no domain imports the platform"
    assert not any(a == "engine" for a, _ in drawn), "the engine imports none of the others"


@readme_example("architecture-request")
def test_request_diagram_names_real_parts(example: Example) -> None:
    assert example.lang == "mermaid"
    for name in ("Scheduler", "ModelRunner", "Sampler", "EngineRequest", "EngineClient"):
        assert name in example.text and class_defined(name), name
    for route in re.findall(r"(?:GET|POST) (/v1/[\w/]+)", example.text):
        assert route in (REPO_ROOT / "docs" / "api.md").read_text()


@readme_example("architecture-deployment")
def test_deployment_diagram_names_real_parts(example: Example) -> None:
    from loraplex.platform.settings import Settings

    assert example.lang == "mermaid"
    for part in ("PostgreSQL", "Redis", "Celery worker", "Celery beat", "loraplex serve", "shared adapter storage"):
        assert part in example.text, part
    replica = re.search(r"replica (gpu-\d)", example.text).group(1)
    assert Settings(replica_id=replica).replica_id == replica
    assert "LORAPLEX_REPLICA_ID=gpu-0" in (REPO_ROOT / "docs" / "production.md").read_text()
