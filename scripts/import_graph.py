"""The package's import graph, every `import` followed (function-level ones included).

    python scripts/import_graph.py            # upward imports and cycles; exit 1 if any

`LAYERS` is the order written in docs/architecture.md: a module may import its own layer or
a lower one, never a higher one. tests/test_layers.py runs the same check.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "veloxquant_mlx"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# Layer of each module, by longest matching dotted prefix (relative to the package).
LAYERS = {
    # 1. ground
    "config": 1, "settings": 1, "packing": 1, "rotations": 1, "codebooks": 1, "formats": 1,
    "attention": 1, "errors": 1, "method_registry": 1, "checksums": 1, "texts": 1, "blas": 1,
    "footprint": 1, "outputs": 1,
    # 2. methods
    "methods": 2,
    # 3. storage and engine with kernels
    "storage": 3, "engine": 3, "kept": 3, "kernels": 3, "history": 3, "codec_set": 3,
    # 4. cache, batch and rotating
    "cache": 4, "batch": 4, "batch_columns": 4, "batch_latent": 4, "batch_decode": 4, "rotating": 4, "kernel_cases": 4, "cache_integrity": 4,
    # 5. integration, artifacts, calibration, presets
    "integration": 5, "attention_hook": 5, "artifacts": 5, "calibration": 5, "presets": 5, "prompt_cache": 5, "kvlayout": 5,
    "sharding": 5, "sharded_files": 5,
    # 6. models and weights
    "models": 6, "gguf": 6, "weights": 6,
    # 7. faces
    "cli": 7, "cli_shared": 7, "chat": 7, "server": 7, "server_requests": 7, "server_admission": 7, "demo": 7, "evaluation": 7, "planning": 7,
    "distributed_io": 7, "selftest": 7, "weights.cli": 7, "weights.selftest": 7, "kernels.selftest": 7,
    "": 7,  # the package's __init__ re-exports the public API
}
LAYER_NAMES = {1: "ground", 2: "methods", 3: "storage/engine/kernels", 4: "cache",
               5: "integration/artifacts/calibration/presets", 6: "models/weights", 7: "faces"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + ".") or prefix == "":
            n = len(prefix)
            if n > best_len:
                best, best_len = layer, n
    return best


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        base = node.module or ""
        if base != PACKAGE and not base.startswith(PACKAGE + "."):
            return []
        base = base[len(PACKAGE) + 1:] if base != PACKAGE else ""
    else:
        parts = module.split(".") if module else []
        if not is_package:
            parts = parts[:-1]
        up = node.level - 1
        parts = parts[: len(parts) - up] if up else parts
        base = ".".join(parts + ([node.module] if node.module else []))
    targets = []
    for alias in node.names:
        sub = f"{base}.{alias.name}" if base else alias.name
        targets.append(sub if _exists(sub) else base)
    return targets


def _exists(module: str) -> bool:
    p = ROOT.joinpath(*module.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def imports_of(path: Path) -> dict[str, int]:
    """{imported module: line} for every import statement in the file, at any depth."""
    module = module_name(path)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    found.setdefault(alias.name[len(PACKAGE) + 1:], node.lineno)
        elif isinstance(node, ast.ImportFrom):
            for target in _resolve(module, is_package, node):
                found.setdefault(target, node.lineno)
    found.pop(module, None)
    return found


def graph() -> dict[str, dict[str, int]]:
    return {module_name(p): imports_of(p) for p in sorted(ROOT.rglob("*.py"))}


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(len(parts))}


def upward_imports(g: dict) -> list[tuple[str, str, int]]:
    """(importer, imported, line) where the imported module sits in a higher layer. Importing a
    parent package (which Python runs anyway) is not counted."""
    bad = []
    for module, targets in g.items():
        for target, line in targets.items():
            if target in _ancestors(module):
                continue
            if layer_of(target) > layer_of(module):
                bad.append((module, target, line))
    return bad


def cycles(g: dict) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, {}):
            if w in _ancestors(v):
                continue
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
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def main() -> int:
    g = graph()
    bad = upward_imports(g)
    comps = cycles(g)
    for module, target, line in bad:
        print(f"upward: {module or PACKAGE} (layer {layer_of(module)}) imports {target} "
              f"(layer {layer_of(target)}) at line {line}")
    for comp in comps:
        print(f"cycle of {len(comp)}: {' '.join(comp)}")
    print(f"{len(g)} modules, {sum(len(t) for t in g.values())} import edges, "
          f"{len(bad)} upward imports, {len(comps)} cycles")
    return 1 if bad or comps else 0


if __name__ == "__main__":
    sys.exit(main())
