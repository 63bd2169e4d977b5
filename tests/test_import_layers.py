"""Data flows through `polar_mitm.storage`: the packages that read what others wrote never import the writer.

Every on-disk contract (records, merged sequences, rewards, the engine description) lives in `storage/`, so
reconstruct, train, rollout and report need nothing from the gateway (but the handle that starts a gateway
process, `ALLOWED`), train needs nothing from reconstruct, and storage itself sits below them all. Imports are read
the way the cycle check reads them (`test_import_cycles`): module level and inside functions alike, all but
`if TYPE_CHECKING:`.
"""

from __future__ import annotations

from pathlib import Path

from tests.test_import_cycles import PACKAGE_ROOT, _write, import_graph

# (importing package, imported package, why the edge is forbidden)
FORBIDDEN = [
    *(
        (f"polar_mitm.{reader}", "polar_mitm.gateway", "records and the engine file are storage's")
        for reader in ("reconstruct", "train", "rollout", "report", "tasks", "loop", "service")
    ),
    # The rollout service (issue 40) drives the runner, the merge and the engines; none of them knows it, and the
    # loop is one of its clients, never the other way.
    *(
        (f"polar_mitm.{below}", "polar_mitm.service", "the service drives them; they know nothing of it")
        for below in ("rollout", "tasks", "engines", "reconstruct", "train", "gateway", "storage")
    ),
    ("polar_mitm.service", "polar_mitm.loop", "the loop is a client of the service"),
    ("polar_mitm.train", "polar_mitm.reconstruct", "the merged-sequence schema is storage's"),
    # The rooms of issue 37: task files and graders below the runner, the runner below the loop that drives it.
    ("polar_mitm.tasks", "polar_mitm.rollout", "task files and graders know nothing of the runner"),
    ("polar_mitm.tasks", "polar_mitm.loop", "task files and graders know nothing of the loop"),
    ("polar_mitm.rollout", "polar_mitm.loop", "the runner knows nothing of the loop that drives it"),
    # Judges (issue 42) run on a finished rollout's sessions and records: below the runner, the loop and the service
    # that call them, above the task file that only declares a task's judge.
    *(
        ("polar_mitm.judges", f"polar_mitm.{above}", "judges are called by them, after the sessions")
        for above in ("rollout", "loop", "service", "gateway")
    ),
    ("polar_mitm.tasks", "polar_mitm.judges", "a task file declares its judge; polar_mitm/judges/ runs it"),
    # The engine room sits below the gateway and everything that drives rollouts and training.
    *(
        ("polar_mitm.engines", f"polar_mitm.{above}", "the engine room is below the gateway and the loop")
        for above in ("gateway", "loop", "rollout", "tasks", "train")
    ),
    *(
        (
            f"polar_mitm.{user}",
            "polar_mitm.train.cli",
            "a GRPO run's parts are train/run.py's and config_options'",
        )
        for user in ("loop", "rollout", "tasks", "report", "reconstruct", "engine", "gateway")
    ),
]
# Edges a FORBIDDEN rule would catch that carry no stored data: (importing package, imported module, why allowed).
ALLOWED = [
    (
        f"polar_mitm.{starter}",
        "polar_mitm.gateway.processes",
        "starting, switching and stopping a gateway process (the runner and the loop start theirs) is no record code",
    )
    for starter in ("rollout", "loop", "service")
] + [
    (
        "polar_mitm.service",
        "polar_mitm.gateway.exposure",
        "whether a listen address is loopback (the service refuses to listen beyond it without a token)",
    )
]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def forbidden_edges(
    graph: dict[str, set[str]],
    forbidden: list[tuple[str, str, str]],
    allowed: list[tuple[str, str, str]] | None = None,
) -> list[str]:
    """One line per import that crosses a forbidden edge (and is not an allowed one), sorted."""
    return sorted(
        f"{module} → {target} ({why})"
        for module, targets in graph.items()
        for target in targets
        for source, banned, why in forbidden
        if _within(module, source)
        and _within(target, banned)
        and not any(_within(module, user) and _within(target, used) for user, used, _ in allowed or ())
    )


def storage_escapes(graph: dict[str, set[str]], root: str = "polar_mitm") -> list[str]:
    """Imports from `storage` of any module of the package outside it (storage must sit below the rest)."""
    return sorted(
        f"{module} → {target}"
        for module, targets in graph.items()
        if _within(module, f"{root}.storage")
        for target in targets
        if _within(target, root) and not _within(target, f"{root}.storage")
    )


def test_readers_of_stored_data_do_not_import_its_writer():
    graph = import_graph(PACKAGE_ROOT)
    assert "polar_mitm.storage.records" in graph, "the package was not found where the test looks for it"
    crossings = forbidden_edges(graph, FORBIDDEN, ALLOWED)
    assert not crossings, "imports that should go through polar_mitm.storage:\n" + "\n".join(crossings)


def test_storage_imports_nothing_above_it():
    escapes = storage_escapes(import_graph(PACKAGE_ROOT))
    assert not escapes, "polar_mitm.storage must not import the packages it serves:\n" + "\n".join(escapes)


def test_the_layer_checks_find_a_lazy_forbidden_import(tmp_path: Path):
    """The checks must be able to fail: a function-level import across a forbidden edge is found."""
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/gateway/__init__.py": "",
            "pkg/gateway/info.py": "ENGINE_FILE = '_engine.json'\n",
            "pkg/storage/__init__.py": "",
            "pkg/storage/rows.py": "def f():\n    from pkg.train import loop\n    return loop\n",
            "pkg/train/__init__.py": "",
            "pkg/train/loop.py": "def f():\n    from ..gateway.info import ENGINE_FILE\n    return ENGINE_FILE\n",
        },
    )
    graph = import_graph(pkg)
    assert forbidden_edges(graph, [("pkg.train", "pkg.gateway", "why")]) == [
        "pkg.train.loop → pkg.gateway.info (why)"
    ]
    # An allowed edge is allowed only for the module it names.
    assert (
        forbidden_edges(graph, [("pkg.train", "pkg.gateway", "why")], [("pkg.train", "pkg.gateway.info", "")])
        == []
    )
    assert forbidden_edges(
        graph, [("pkg.train", "pkg.gateway", "why")], [("pkg.train", "pkg.gateway.other", "")]
    )
    assert storage_escapes(graph, "pkg") == ["pkg.storage.rows → pkg.train.loop"]
