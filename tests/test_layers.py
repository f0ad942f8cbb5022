"""The import graph of backend/, ui/ and app.py, read with ``ast`` (imports inside functions too).

(a) no cycles among the modules; (b) ui/ reaches the backend only through its facade modules
and never imports torch or diffusers; (c) backend/ never imports gradio, nor the benchmarks in bench/. The graph is built
from whatever modules exist, so new modules are checked as they appear.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What ui/ may import from backend/: the Studio facade and the plain modules it hands out.
UI_ALLOWED = ("backend.service", "backend.errors")
HEAVY = ("torch", "diffusers", "transformers", "peft", "safetensors.torch")


def _modules() -> dict[str, Path]:
    files = sorted((ROOT / "backend").rglob("*.py")) + sorted((ROOT / "ui").rglob("*.py")) + [ROOT / "app.py"]
    out = {}
    for f in files:
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, known) -> list[tuple[str, int]]:
    """(imported name, line) for every import in the file, wherever it is; relative ones made absolute,
    ``from pkg import mod`` as the module ``pkg.mod`` when it is one."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base if is_pkg else base[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub if sub in known else mod, node.lineno))
    return out


def _graph():
    known = _modules()
    edges: dict[str, dict[str, int]] = {m: {} for m in known}
    raw = {}
    for m, path in known.items():
        raw[m] = _imports(m, path, known)
        for target, line in raw[m]:
            while target and target not in known:  # backend.lora.request.LoRARequest -> backend.lora.request
                target = target.rpartition(".")[0]
            if target and target != m:
                edges[m].setdefault(target, line)
    return known, edges, raw


def _cycle(edges) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative DFS, colours)."""
    colour = {m: 0 for m in edges}
    for start in sorted(edges):
        if colour[start]:
            continue
        stack = [(start, iter(sorted(edges[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour[child] == 1:
                return path[path.index(child):] + [child]
            elif colour[child] == 0:
                colour[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(edges[child]))))
    return None


def test_the_import_graph_has_no_cycles():
    _, edges, _ = _graph()
    cycles = []
    for _ in range(50):  # every independent cycle, each reported once: cut one edge of each found
        found = _cycle(edges)
        if not found:
            break
        cycles.append(" -> ".join(f"{a} (line {edges[a][b]})" for a, b in zip(found, found[1:])) + f" -> {found[-1]}")
        del edges[found[-2]][found[-1]]
    assert not cycles, "import cycles (imports inside functions count):\n  " + "\n  ".join(cycles)


def test_ui_reaches_the_backend_only_through_the_facade():
    known, _, raw = _graph()
    bad = []
    for m, imports in raw.items():
        if not m.startswith("ui"):
            continue
        for target, line in imports:
            top = target.split(".")[0]
            if target.startswith(HEAVY) or top in {h.split(".")[0] for h in HEAVY if "." not in h}:
                bad.append(f"{known[m].relative_to(ROOT)}:{line} imports {target}")
            elif top == "backend" and not target.startswith(UI_ALLOWED):
                bad.append(f"{known[m].relative_to(ROOT)}:{line} imports {target} (allowed: {', '.join(UI_ALLOWED)})")
    assert not bad, "\n".join(bad)


def test_backend_never_imports_gradio():
    known, _, raw = _graph()
    bad = [f"{known[m].relative_to(ROOT)}:{line} imports {t}" for m, imports in raw.items()
           if m.startswith("backend") for t, line in imports if t.split(".")[0] in ("gradio", "gradio_client", "ui")]
    assert not bad, "\n".join(bad)


def test_the_runtime_never_imports_benchmark_code():
    """#42: benchmarks and the cost model live in bench/, outside the runtime package."""
    known, _, raw = _graph()
    bad = [f"{known[m].relative_to(ROOT)}:{line} imports {t}" for m, imports in raw.items()
           for t, line in imports if t.split(".")[0] == "bench"]
    assert not bad, "\n".join(bad)
    assert not [p for p in (ROOT / "backend").rglob("*.py") if "bench" in p.stem or p.stem == "costmodel"]


# Private state reached from another module: the known friends (the unfused path is the engine's
# other half; torch's hook dicts; diffusers' modular internals). Anything new here is a layer
# violation: give the owner a public method instead (e.g. PipelineManager.exclusive(),
# LRUTier.peek(), params.check_field()).
FRIENDS = {
    "backend/lora/unfused.py": {"_active_key", "_active_meta", "_changed", "_contributions", "_device_factors",
                                "_merged", "_params", "_plan", "_refusal", "_unfused_factors",
                                "_lora_studio_forwards", "_forward_hooks"},
    "backend/jobs/prefetch.py": {"_device_factors"},
    "backend/jobs/queue.py": {"_changed", "_db", "_lock"},  # the queue's own helper class
    "backend/jobs/worker.py": {"_take_cancels", "_cancelled"},  # _MemberCancel: the worker's own helper class
    "backend/minimax/pipeline.py": {"_load_pipeline_config", "_execution_device"},
}


def test_no_module_reaches_into_another_ones_private_state():
    bad = []
    for path in sorted((ROOT / "backend").rglob("*.py")) + sorted((ROOT / "ui").rglob("*.py")) + [ROOT / "app.py"]:
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr not in FRIENDS.get(rel, set()):
                bad.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not bad, "private attributes read from outside their module:\n  " + "\n  ".join(bad)
