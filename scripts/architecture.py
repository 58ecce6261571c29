"""Draw fanstore's architecture from its code: which package imports which (docs/architecture.png), and check the
read paths docs/ARCHITECTURE.md names against the imports.

The packages are the roles of docs/LAYOUT.md: the command line, the read core, the packer, the mount, serve, the
PyTorch datasets, the demo, and the codec and selector libraries beside them. An arrow A -> B means a module of A
imports a module of B; a dashed arrow means every such import is made inside a function (loaded only when used:
`import fanstore` stays light). Module counts and lines are in each box.

Usage: python scripts/architecture.py [--out docs/architecture.png] [--check]
  --check   only check that each `a -> b` step of the read paths in docs/ARCHITECTURE.md is an import of b by a
            (steps written `a ~> b` cross a socket or MPI and are not imports); exit 1 naming a step that is not
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("fanstore", "compressors", "selector")
# Where each package is drawn (x, y), top to bottom in the order data flows through a job.
PLACES = {
    "fanstore (cli)": (0.50, 0.95),
    "fanstore.demo": (0.12, 0.78),
    "fanstore.pack": (0.30, 0.60),
    "fanstore.serve": (0.72, 0.60),
    "fanstore.torch": (0.92, 0.78),
    "fanstore.mount": (0.50, 0.40),
    "fanstore.core": (0.50, 0.18),
    "selector": (0.12, 0.36),
    "compressors": (0.20, 0.05),
}


@dataclass
class Module:
    name: str  # dotted
    package: str  # a key of PLACES
    lines: int
    imports: dict[str, bool] = field(default_factory=dict)  # imported module -> at module level (not in a function)


def package_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "fanstore":
        return parts[0]
    if len(parts) > 2 or (len(parts) == 2 and (REPO / "fanstore" / parts[1]).is_dir()):
        return f"fanstore.{parts[1]}"
    return "fanstore (cli)"  # the top level: __init__, __main__, cli, errors


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def read_modules() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            name = module_name(path)
            tree = ast.parse(path.read_text(), str(path))
            module = Module(name, package_of(name), len(path.read_text().splitlines()))
            top_level = {id(node) for node in tree.body}
            for node in ast.walk(tree):
                targets: list[str] = []
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = resolve(name, path.name == "__init__.py", node)
                    targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
                for target in targets:
                    if target.split(".")[0] in ROOTS:
                        eager = id(node) in top_level
                        module.imports[target] = module.imports.get(target, False) or eager
            modules[name] = module
    for module in modules.values():  # keep only names that are modules (`from .x import Name` names a module x)
        module.imports = {target: eager for target, eager in module.imports.items() if target in modules}
    return modules


def package_edges(modules: dict[str, Module]) -> dict[tuple[str, str], bool]:
    """(importer, imported) package -> whether any of those imports is made at module level."""
    edges: dict[tuple[str, str], bool] = {}
    for module in modules.values():
        for target, eager in module.imports.items():
            pair = (module.package, modules[target].package)
            if pair[0] != pair[1] and not target.endswith("fanstore") and not pair[1] == "fanstore (cli)":
                edges[pair] = edges.get(pair, False) or eager
    return edges


def draw(modules: dict[str, Module], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(11, 8))
    axes.set_axis_off()
    boxes = {}
    for package, (x, y) in PLACES.items():
        members = [module for module in modules.values() if module.package == package]
        label = f"{package}\n{len(members)} modules, {sum(m.lines for m in members):,} lines"
        boxes[package] = axes.text(x, y, label, ha="center", va="center", fontsize=10, zorder=3,
                                   bbox={"boxstyle": "round,pad=0.6", "edgecolor": "0.3",
                                         "facecolor": "#e8f0fa" if package.startswith("fanstore") else "#f3f3f3"})
    figure.canvas.draw()  # the boxes get their sizes: arrows end at their edges
    to_data = axes.transData.inverted()
    halves = {}
    for package, box in boxes.items():
        (x0, y0), (x1, y1) = to_data.transform(box.get_bbox_patch().get_window_extent())
        halves[package] = ((x1 - x0) / 2, (y1 - y0) / 2)
    for (source, target), eager in sorted(package_edges(modules).items()):
        start, end = _edge_point(PLACES[source], PLACES[target], halves[source]), \
            _edge_point(PLACES[target], PLACES[source], halves[target])
        axes.annotate("", xy=end, xytext=start, zorder=2,
                      arrowprops={"arrowstyle": "-|>", "color": "0.3", "lw": 1.2, "mutation_scale": 16,
                                  "shrinkA": 0, "shrinkB": 0, "linestyle": "-" if eager else "--"})
    axes.set_title("fanstore: which package imports which (dashed: only inside functions)\n"
                   "made by scripts/architecture.py from the code", fontsize=11)
    figure.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(figure)


def _edge_point(centre: tuple[float, float], towards: tuple[float, float],
                half: tuple[float, float]) -> tuple[float, float]:
    """Where the line from a box's centre towards another point leaves the box."""
    dx, dy = towards[0] - centre[0], towards[1] - centre[1]
    scale = min(half[0] / abs(dx) if dx else float("inf"), half[1] / abs(dy) if dy else float("inf"))
    return centre[0] + dx * scale, centre[1] + dy * scale


STEP = re.compile(r"`([\w./]+)`\s*(->|~>)\s*(?=`([\w./]+)`)")


def check_paths(modules: dict[str, Module], doc: Path) -> list[str]:
    """Each `a -> b` of the doc whose modules are named as paths (fanstore/core/api.py) must be an import of b by a;
    `a ~> b` steps cross a socket or MPI and are only checked to name modules that exist."""
    problems = []
    for source, arrow, target in STEP.findall(doc.read_text()):
        names = [module_name(REPO / name) if name.endswith(".py") else None for name in (source, target)]
        if None in names:
            continue
        missing = [name for name in names if name not in modules]
        if missing:
            problems.append(f"{doc.name}: `{source}` {arrow} `{target}`: no module {missing[0]}")
        elif arrow == "->" and names[1] not in modules[names[0]].imports:
            problems.append(f"{doc.name}: `{source}` -> `{target}`: {names[0]} does not import {names[1]}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "architecture.png")
    parser.add_argument("--check", action="store_true")
    options = parser.parse_args()
    modules = read_modules()
    problems = check_paths(modules, REPO / "docs" / "ARCHITECTURE.md")
    for problem in problems:
        print(problem, file=sys.stderr)
    if not options.check:
        draw(modules, options.out)
        print(f"wrote {options.out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
