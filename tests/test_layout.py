"""The code's layering: no import circles, and every import goes down the layers (docs/layout.md).

Every import counts, the ones inside functions and under TYPE_CHECKING too: a lazy import is
still a dependency, and a circle through one is still a circle."""

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "shard_ray"
# From the bottom up; a module imports from its own package or from a lower layer only.
LAYERS = (
    ("errors", "quiet"),
    ("arguments", "io", "niceness", "process_groups", "threads"),
    ("neighbours",),
    ("runtime",),
    ("configfile", "hosts"),
    ("workload",),
    ("plan",),
    ("interop", "profiling"),
    ("costmodel", "tracking"),
    ("policy",),
    ("placement",),
    ("workflows",),
    ("tuning",),
    ("doctor",),
    ("cli",),
)
LAYER_OF = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of other shard_ray modules (a name imported from a package resolves to its module)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    imports: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("shard_ray.") else None
                if target not in (None, module, "shard_ray"):
                    imports[module].add(target)
    return imports


def _part(module: str) -> str:
    return module.split(".")[1]


def test_every_package_has_a_layer():
    parts = {_part(m) for m in _modules() if m != "shard_ray"}
    assert parts <= set(LAYER_OF), f"give {sorted(parts - set(LAYER_OF))} a layer in LAYERS"


def test_imports_go_down_the_layers():
    upward = [
        f"{module} imports {target}"
        for module, targets in _imports(_modules()).items()
        for target in targets
        if _part(module) != _part(target) and LAYER_OF[_part(target)] >= LAYER_OF[_part(module)]
    ]
    assert not upward, upward


def test_no_module_imports_itself_through_others():
    imports = _imports(_modules())
    circles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            circles.append(" -> ".join(path[path.index(module) :] + [module]))
            return
        if module in done:
            return
        for target in sorted(imports.get(module, ())):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(imports):
        visit(module, [])
    assert not circles, circles
