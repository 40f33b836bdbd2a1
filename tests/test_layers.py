"""The layers of docs/architecture.md, enforced on the import graph (an AST read of every module of ditsp,
function-local imports included): no upward import, between packages and inside a model family's folder, no
import circle, and no torch.distributed collective outside ``ditsp/distributed/``."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ditsp"

# Top to bottom; a module may import its own layer's packages and anything below, never above.
LAYERS = (
    ("cli",),
    ("commands", "comfyui"),  # front doors (the ComfyUI nodes run jobs on the server's persistent workers)
    ("bench",),  # benchmarks run the server and the jobs
    ("serve", "train", "rl"),  # front doors' back ends: a persistent SP group, training and RL post-training under SP
    ("argtypes", "fixed_shape_probe"),  # front-door helpers: shared argument types, the doctor's probe of model kernels
    ("models", "integrations"),
    ("sp", "attention"),
    ("windows", "weights", "io"),
    ("distributed",),
    ("config", "cpu", "dtypes", "errors", "fixed_shape", "memory", "row_blocks", "scoped_env"),
)
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
# Inside a model family's folder (models/<family>/), top to bottom: the networks never reach up to what builds,
# parallelises, feeds or runs them (a model never builds its own runtime: its caller passes one).
FAMILY_LAYERS = (
    ("job", "verify"),  # jobs on the model (restoration, one forward, plan) and the reference vectors' checks
    ("weights", "parallelize", "packed", "pipeline", "presets"),  # what builds, parallelises and feeds the networks
    ("nadit", "vae", "compiled"),  # the networks and their compiled kernels
)
FAMILY_RANK = {name: i for i, names in enumerate(FAMILY_LAYERS) for name in names}
# Sub-packages with a layer of their own, not their parent's: the ComfyUI nodes live with the integrations
# (ditsp/integrations/comfyui) but are a front door.
SUBPACKAGE_LAYERS = {"integrations.comfyui": "comfyui"}
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
    "batch_isend_irecv",
}
# Benchmarks that time torch's own primitives against ditsp's (a baseline is torch.distributed by definition).
COLLECTIVE_BASELINES = {"ditsp.bench.attention", "ditsp.bench.attention_baselines", "ditsp.bench.diffusers"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = ["ditsp", *p.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _targets(mod: str, path: pathlib.Path, node: ast.AST) -> list[str]:
    """The ditsp modules an import statement loads (``from pkg import name`` counts pkg.name when a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("ditsp")]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        parts = pkg.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if not base.startswith("ditsp"):
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _imports(mod: str, path: pathlib.Path, text: str | None = None) -> set[tuple[str, int]]:
    """(module, line) of every ditsp import of ``mod`` (its file, or ``text`` read as that file), in functions too."""
    tree = ast.parse(path.read_text() if text is None else text)
    return {(t, n.lineno) for n in ast.walk(tree) for t in _targets(mod, path, n) if t != mod}


def _graph() -> dict[str, set[tuple[str, int]]]:
    return {mod: _imports(mod, path) for mod, path in MODULES.items()}


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return SUBPACKAGE_LAYERS.get(".".join(parts[1:3]), parts[1] if len(parts) > 1 else "")


def test_every_top_level_package_has_a_layer():
    tops = {_layer(m) for m in MODULES} - {""}
    assert tops <= set(RANK), f"add {sorted(tops - set(RANK))} to LAYERS (and docs/architecture.md)"


def test_no_upward_import():
    up = []
    for mod, targets in _graph().items():
        a = _layer(mod)
        for t, line in targets:
            b = _layer(t)
            if a and b and a != b and RANK[b] < RANK[a]:
                up.append(f"{MODULES[mod].relative_to(ROOT.parent)}:{line} imports {t} ({a} is below {b})")
    assert not up, "upward imports:\n" + "\n".join(sorted(up))


def _family_unit(mod: str) -> tuple[str, str] | None:
    """(family, unit) of a module inside a model family's folder: ``ditsp.models.seedvr2.nadit.model`` ->
    (seedvr2, nadit); None outside one (``models/meta.py``, a family's own ``__init__``)."""
    parts = mod.split(".")
    return (parts[2], parts[3]) if len(parts) >= 4 and parts[1] == "models" else None


# models/'s own modules (meta, resident, ...): what every family uses, so below them all
MODELS_SHARED = {m for m, p in MODULES.items() if m.count(".") == 2 and _layer(m) == "models" and p.name != "__init__.py"}


def _upward_in_families(graph: dict[str, set[tuple[str, int]]]) -> list[str]:
    up = []
    for mod, targets in graph.items():
        a = _family_unit(mod)
        for t, line in targets:
            b = _family_unit(t)
            if a and b and a[0] == b[0] and a[1] != b[1] and FAMILY_RANK[b[1]] < FAMILY_RANK[a[1]]:
                up.append(f"{mod}:{line} imports {t} ({a[1]} is below {b[1]})")
            elif b and mod in MODELS_SHARED:
                up.append(f"{mod}:{line} imports {t} (models' shared modules are below every family)")
    return sorted(up)


def test_every_unit_of_a_model_family_has_a_layer():
    units = {u[1] for u in map(_family_unit, MODULES) if u}
    assert units <= set(FAMILY_RANK), f"add {sorted(units - set(FAMILY_RANK))} to FAMILY_LAYERS (and docs/architecture.md)"


def test_no_upward_import_inside_a_model_family():
    up = _upward_in_families(_graph())
    assert not up, "upward imports inside a model family:\n" + "\n".join(up)


def test_a_model_building_its_own_runtime_in_a_function_is_upward():
    """The check reads function-local imports: a network that imports what parallelises it inside a method
    (the model building its own runtime) is refused, wherever the import sits."""
    mod = "ditsp.models.seedvr2.nadit.model"
    builds_its_runtime = (
        "class NaDiT:\n"
        "    def single_runtime(self, grid):\n"
        "        from ..parallelize import parallelize  # local\n"
        "        return parallelize(self.cfg, None, grid)\n"
    )
    up = _upward_in_families({mod: _imports(mod, MODULES[mod], builds_its_runtime)})
    assert up == [f"{mod}:3 imports ditsp.models.seedvr2.parallelize (nadit is below parallelize)"]


def test_no_import_circle():
    g = {m: {t for t, _ in ts if t in MODULES} for m, ts in _graph().items()}
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_no_collective_outside_the_distributed_layer():
    """``dist.<collective>(...)`` / ``torch.distributed.<collective>(...)`` only in ditsp/distributed/."""
    found = []
    for mod, path in MODULES.items():
        if mod.startswith("ditsp.distributed") or mod in COLLECTIVE_BASELINES:
            continue
        tree = ast.parse(path.read_text())
        aliases = {"torch.distributed"}
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                aliases |= {a.asname for a in n.names if a.name == "torch.distributed" and a.asname}
            elif isinstance(n, ast.ImportFrom) and n.module == "torch" and any(a.name == "distributed" for a in n.names):
                aliases |= {a.asname or a.name for a in n.names if a.name == "distributed"}
            elif isinstance(n, ast.ImportFrom) and n.module == "torch.distributed":
                found += [f"{mod}:{n.lineno} imports {a.name}" for a in n.names if a.name in COLLECTIVES]
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in COLLECTIVES:
                owner = ast.unparse(n.func.value)
                if owner in aliases:
                    found.append(f"{path.relative_to(ROOT.parent)}:{n.lineno} calls {owner}.{n.func.attr}")
    assert not found, "collectives outside ditsp/distributed/ (add a counted method to Comm):\n" + "\n".join(found)


def test_no_process_wide_registry_keyed_by_comm():
    """Settings travel with the object that uses them (a runtime's or an attention strategy's Transport):
    no module keeps a module-level table keyed by Comm objects (a weak-key dict, or a dict annotated with Comm)."""
    found = []
    for mod, path in MODULES.items():
        for n in ast.parse(path.read_text()).body:
            if not isinstance(n, (ast.Assign, ast.AnnAssign)) or n.value is None:
                continue
            text = ast.unparse(n.value) + (ast.unparse(n.annotation) if isinstance(n, ast.AnnAssign) else "")
            if "WeakKeyDictionary" in text or ("Comm" in text and "dict" in text.lower()):
                found.append(f"{path.relative_to(ROOT.parent)}:{n.lineno}: {ast.unparse(n)[:100]}")
    assert not found, "process-wide registries keyed by Comm (hold the state on the object that uses it):\n" + \
        "\n".join(found)


def test_every_row_all_to_all_goes_through_the_transport():
    """``<comm>.all_to_all_single(...)`` only in ditsp/distributed/ (the transport, and Comm's own reduction
    primitives) and in the benchmarks that time the raw primitive: every other all-to-all of rows goes
    through :class:`ditsp.distributed.transport.Transport` (one policy, chunking, agreement)."""
    allowed = ("ditsp.distributed", "ditsp.bench.link") + tuple(COLLECTIVE_BASELINES)
    found = []
    for mod, path in MODULES.items():
        if mod.startswith(allowed):
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "all_to_all_single":
                found.append(f"{path.relative_to(ROOT.parent)}:{n.lineno}")
    assert not found, "all-to-alls outside the transport:\n" + "\n".join(found)


def test_torchrun_is_detected_in_one_place():
    """Whether torchrun started this process is :func:`ditsp.distributed.torchrun.under_torchrun`'s answer
    alone: no other module reads torchrun's RANK / WORLD_SIZE (the launcher's ``init_from_env`` checks the
    variables it joins the job with)."""
    allowed = {"ditsp.distributed.torchrun", "ditsp.distributed.launcher"}
    found = [f"{path.relative_to(ROOT.parent)}:{n.lineno}" for mod, path in MODULES.items() if mod not in allowed
             for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.Constant) and n.value in ("RANK", "WORLD_SIZE")]
    assert not found, "torchrun detected outside under_torchrun() (call it instead):\n" + "\n".join(found)
