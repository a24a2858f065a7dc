"""The code's layers point one way: packages import only packages below them (``ORDER``), and no module imports,
directly or through others, a module that imports it.

Read from the source (every ``import``, at the top or inside a function, except under
``if TYPE_CHECKING:``), so a cycle shows here before it shows as a half-initialised module
at run time, and an import moved into a function to hide one still counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mooncake", "conductor", "prefill", "decode", "kvstore", "transfer", "protos", "benchmarks")

# The packages from the bottom up: each imports only packages of the layers before its own (a module of a package
# listed here belongs to the longest name it starts with). A new package must be placed here.
ORDER = (
    ("transfer", "protos"),  # the transfer engine; the generated wire types
    ("mooncake", "mooncake.blocks", "mooncake.tls", "mooncake.faults", "mooncake.cliargs", "mooncake.localproc"),
    ("mooncake.runtime",),  # process plumbing: READY, signals, channels, the Conductor link, /metrics, framed RPC
    ("mooncake.engine",),  # our engine, and the interface both engines implement
    ("mooncake.vllm_engine",),
    ("mooncake.serving",),  # what the workers share above the engines
    ("kvstore",),
    ("conductor",),  # the Conductor's decisions: pure, time passed in
    ("conductor.planner",),  # capacity: the planner and the twin it checks plans on (runs the decisions above)
    ("conductor.planning",),  # the planner in the running Conductor: its thread, metrics, acting
    ("conductor.service",),  # the Conductor's process around both: its state and threads,
    ("conductor.servicer",),  # its gRPC adapter,
    ("conductor.__main__",),  # and its command line
    ("prefill", "decode"),
    ("mooncake.gateway",),  # the OpenAI API and its backends (the cluster's, one engine's)
    ("mooncake.cluster",),  # mooncake up's launcher
    ("mooncake.cli",),
    ("benchmarks",),
)


def _modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The project's modules that ``name`` imports (a package's submodule when ``from package import submodule``)."""

    def ours(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    tree = ast.parse(path.read_text())
    hidden = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        out.update(m for m in map(ours, targets) if m is not None and m != name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_reader_sees_the_imports_it_must_see():
    graph = _graph()
    assert "kvstore.wire" in graph["kvstore.client"]  # from kvstore.wire import ...
    assert "mooncake.tls" in graph["conductor.pool"]  # from mooncake import tls (a submodule by name)
    assert "mooncake.vllm_engine.engine" in graph["mooncake.serving.build"]  # imported inside a function
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others():
    cycles = _cycles(_graph())
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def _package(module: str) -> str | None:
    listed = [p for layer in ORDER for p in layer if module == p or module.startswith(p + ".")]
    return max(listed, key=len, default=None)


def test_packages_import_only_the_layers_below_them():
    rank = {p: i for i, layer in enumerate(ORDER) for p in layer}
    graph = _graph()
    unplaced = sorted(m for m in graph if _package(m) is None)
    assert unplaced == [], f"modules of packages ORDER does not place: {unplaced}"
    against = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if _package(m) != _package(d) and rank[_package(m)] <= rank[_package(d)]
    )
    assert against == [], "imports against the package order: " + "; ".join(against)


def test_the_order_is_checked_both_ways():
    assert _package("mooncake.engine.model") == "mooncake.engine" and _package("mooncake.tls") == "mooncake.tls"
    assert _package("mooncake.gateway.app") == "mooncake.gateway" and _package("elsewhere") is None
    graph = _graph()
    assert "mooncake.runtime.framed" in graph["kvstore.client"]  # a low package, imported from above
    assert "kvstore.client" in graph["prefill.worker"]


def test_the_transfer_engine_and_the_wire_types_stand_alone():
    """transfer/ is the bottom layer (the pool, the workers and the Conductor's fast path sit on it): it imports
    nothing of the project outside itself; protos/ (generated) imports only protos/."""
    graph = _graph()
    for package in ("transfer", "protos"):
        outside = {
            f"{m} -> {d}"
            for m, deps in graph.items()
            if m.split(".")[0] == package
            for d in deps
            if d.split(".")[0] != package
        }
        assert outside == set(), f"{package}/ reaches out: {sorted(outside)}"


MAX_LINES = 600  # past it a module holds more than one concern: split it by concern before adding to it
PRODUCT = ("mooncake", "conductor", "prefill", "decode", "kvstore", "transfer")


def test_no_product_file_is_over_600_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for package in PRODUCT
        for path in (ROOT / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"files over {MAX_LINES} lines: {long}"


# Every class a worker hosts as its engine, by file: each must have all that WorkerEngine declares.
ENGINES = {
    "mooncake/engine/engine.py": "LLMEngine",
    "mooncake/vllm_engine/engine.py": "VllmEngine",
    "prefill/group.py": "GroupEngine",
}


def _members(path: str, name: str, *, assigned: bool = True) -> set[str]:
    """What class ``name`` of ``path`` defines: its methods and properties, the names its body assigns, and (with
    ``assigned``) every ``self.x`` any of its methods assigns."""
    tree = ast.parse((ROOT / path).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    out = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(cls) if assigned else ():
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                out.add(node.attr)
    return out


def test_every_engine_a_worker_hosts_has_the_whole_interface():
    """The workers call only what ``WorkerEngine`` declares, with no ``getattr`` fallbacks: so ours, vLLM's and a
    pipelined group's engine must each have every member of it."""
    declared = _members("mooncake/engine/interface.py", "WorkerEngine", assigned=False)
    assert {"add_request", "step", "kv_cache", "num_landing_blocks", "land", "block_bytes"} <= declared
    wanted = _parameters("mooncake/engine/interface.py", "WorkerEngine", "add_request")
    assert {"kv", "options"} <= wanted and len(wanted - {"self"}) <= 5  # add_request takes at most five
    for path, name in ENGINES.items():
        missing = declared - _members(path, name)
        assert not missing, f"{name} ({path}) lacks {sorted(missing)} of WorkerEngine"
        taken = _parameters(path, name, "add_request")
        assert taken == wanted, f"{name}.add_request ({path}) takes {sorted(taken)}, not {sorted(wanted)}"


def _parameters(path: str, name: str, method: str) -> set[str]:
    """The parameter names of ``name.method`` in ``path``."""
    tree = ast.parse((ROOT / path).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == method)
    return {a.arg for a in fn.args.args + fn.args.kwonlyargs}
