"""Every data-loader worker imports fanstore and opens the dataset, so the read side must import light, and the
layering that keeps it light must hold: the selector knows nothing of fanstore, in fanstore only the packer and the
command line use the selector, and the read path knows nothing of the serving layer (fanstore/serve/) or MPI.

Import checks run in fresh interpreters: this process has long since imported everything.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, make_tree
from fanstore import PackOptions, pack

# What reading never needs: the packer, its worker processes, the codec selector, codecs the dataset does not use.
NOT_FOR_READING = (
    "fanstore.pack",  # the packer's package, all of it
    "fanstore.pack.compress",
    "fanstore.pack.codec_plan",
    "multiprocessing",
    "concurrent.futures.process",
    "selector",
    "blosc",
    "lz4",
    "fanstore.serve",
    "mpi4py",
    "torch",
)
# The only fanstore modules that may import the selector: the packer (--codec auto: auto_codec; --fit's total:
# fit_watch) and the command line.
USES_THE_SELECTOR = ("fanstore.pack.packer", "fanstore.pack.auto_codec", "fanstore.pack.fit_watch", "fanstore.commands")
# The only modules of fanstore/ (not fanstore/serve/) that may import the serving layer: the command line (`plan`;
# and `serve`'s options, light, for its parser: see test_options_modules_are_light).
USES_THE_SERVING_LAYER = ("fanstore.commands", "fanstore.cli")
# The only module of fanstore/ that may import torch (besides the fanstore.torch package): the demo's PyTorch run.
USES_TORCH = ("fanstore.demo.demo_torch",)
# What the read core (fanstore/core/) never imports: the other roles' packages, FUSE and its event loop, MPI.
NOT_FOR_THE_CORE = ("fanstore.pack", "fanstore.mount", "fanstore.serve", "fanstore.torch", "fanstore.demo",
                    "pyfuse3", "trio", "mpi4py", "torch", "selector")
# fanstore/'s top level holds the public API, the errors, the command line; everything else lives in a package by role.
MOST_TOP_LEVEL_MODULES = 8


def fresh_modules(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code` with this checkout first on its path."""
    # The snapshot comes first: the reporter's own import of fanstore (which checkout is it?) must not count.
    report = ("import json, sys; loaded = sorted(sys.modules); import fanstore; "
              "print(json.dumps([fanstore.__file__, loaded]))")
    proc = subprocess.run([sys.executable, "-c", f"{code}\n{report}"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    fanstore_file, modules = json.loads(proc.stdout.splitlines()[-1])
    assert Path(fanstore_file).is_relative_to(REPO), f"imported another checkout's fanstore: {fanstore_file}"
    return set(modules)


def fanstore_modules() -> list[tuple[str, Path]]:
    """Each module of fanstore/ outside its serve/ and torch/ packages, by dotted name, with its file."""
    modules = []
    for path in sorted((REPO / "fanstore").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[1] not in ("serve", "torch"):
            modules.append((".".join(parts), path))
    return modules


def loaded(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    """Which of `packages` (or their submodules) are among `modules`."""
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in packages))


def imported_names(path: Path) -> set[str]:
    """Every module a source file imports, at module level or inside functions, relative imports spelled in full."""
    package = path.relative_to(REPO).parent.parts
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_import_fanstore_is_light():
    assert loaded(fresh_modules("import fanstore"), NOT_FOR_READING) == []


def test_reading_a_dataset_is_light(tmp_path):
    dest = tmp_path / "ds"
    pack(make_tree(tmp_path / "src"), dest, PackOptions(codec="zstd:3"))
    read = (f"import fanstore\n"
            f"with fanstore.open_dataset({str(dest)!r}) as ds:\n"
            f"    assert ds.read('labels.txt').startswith(b'train/x/img_000.png')\n")
    assert loaded(fresh_modules(read), NOT_FOR_READING) == []


def test_the_selector_imports_nothing_of_fanstore():
    modules = fresh_modules("import selector, selector.report")
    assert "selector.measure" in modules
    assert loaded(modules, ("fanstore",)) == []
    for path in sorted((REPO / "selector").glob("*.py")):  # not even inside a function
        assert loaded(imported_names(path), ("fanstore",)) == [], path.relative_to(REPO)


def test_packer_imports_the_selector_only_to_choose_codecs():
    assert loaded(fresh_modules("import fanstore.pack.packer, fanstore.cli"), ("selector",)) == []


def test_pack_names_stay_on_the_package():
    # dir() and __all__ list them before they are loaded; the packer's module, once imported by anyone, does not
    # take the place of the function `fanstore.pack`.
    modules = fresh_modules(
        "import fanstore\n"
        "assert set(fanstore.__all__) <= set(dir(fanstore)), sorted(set(fanstore.__all__) - set(dir(fanstore)))\n"
        "import fanstore.pack, fanstore.pack.packer\n"
        "from fanstore import PackOptions, PackSummary, pack\n"
        "assert fanstore.pack is pack and callable(pack), fanstore.pack\n"
        "assert all(hasattr(fanstore, name) for name in fanstore.__all__)\n"
        "assert PackSummary.__module__ == 'fanstore.pack.packer'\n"
        "assert PackOptions.__module__ == 'fanstore.pack.options'\n"
    )
    assert "fanstore.pack.packer" in modules


def test_only_the_packer_and_the_command_line_import_the_selector():
    for name, path in fanstore_modules():
        if name not in USES_THE_SELECTOR:
            selector_imports = loaded(imported_names(path), ("selector",))
            assert selector_imports == [], f"{path.relative_to(REPO)} imports {selector_imports}"


def test_the_read_path_knows_nothing_of_the_serving_layer_or_mpi():
    for name, path in fanstore_modules():
        names = imported_names(path)
        assert loaded(names, ("mpi4py",)) == [], f"{path.relative_to(REPO)} imports mpi4py"
        if name not in USES_THE_SERVING_LAYER:
            assert loaded(names, ("fanstore.serve",)) == [], f"{path.relative_to(REPO)} imports the serving layer"
    assert loaded(fresh_modules("import fanstore.cli"), ("fanstore.serve", "mpi4py")) == []


def test_only_fanstore_torch_and_the_demos_pytorch_run_import_torch():
    # `fanstore demo` runs without torch: it looks for torch and imports demo_torch only when it is there.
    for name, path in fanstore_modules():
        if name not in USES_TORCH:
            assert loaded(imported_names(path), ("torch",)) == [], f"{path.relative_to(REPO)} imports torch"
    assert loaded(fresh_modules("import fanstore.cli, fanstore.demo.demo"), ("torch", "fanstore.torch")) == []


# The options modules: each option's default, check and help, which the command line reads to build its parser.
OPTIONS_MODULES = ("fanstore.core.options", "fanstore.mount.options", "fanstore.pack.options", "fanstore.serve.options")
# What they, and so the command line's parse, never load: FUSE, its event loop, MPI, the packer and its workers,
# the mount's and the serve rank's machinery.
NOT_FOR_THE_OPTIONS = ("pyfuse3", "trio", "mpi4py", "multiprocessing", "selector", "fanstore.pack.packer",
                       "fanstore.pack.compress", "fanstore.mount.mount", "fanstore.mount.fuse_ops",
                       "fanstore.serve.node", "fanstore.serve.transport", "fanstore.serve.remote_blobs")


def test_options_modules_are_light():
    for module in OPTIONS_MODULES:
        assert loaded(fresh_modules(f"import {module}"), NOT_FOR_THE_OPTIONS) == [], module
    parse = fresh_modules("from fanstore.cli import _build_parser\n_build_parser().parse_args(['mount', 'a', 'b'])")
    assert loaded(parse, NOT_FOR_THE_OPTIONS) == []


def test_placement_needs_no_mpi():
    # Every rank computes the placement before MPI is up, and `fanstore plan` runs where there is no MPI at all.
    for name in ("__init__.py", "placement.py"):
        assert loaded(imported_names(REPO / "fanstore" / "serve" / name), ("mpi4py",)) == [], name
    assert loaded(fresh_modules("import fanstore.serve.placement"), ("mpi4py",)) == []
    # The package imports none of its modules: `import fanstore.serve.placement` brings placement alone.
    assert loaded(fresh_modules("import fanstore.serve"), ("fanstore.serve",)) == ["fanstore.serve"]


def test_fanstore_torch_reads_without_the_packer_or_mpi(tmp_path):
    """A DataLoader worker imports fanstore.torch and reads: neither the packer nor MPI may come with it. Under
    serve it reaches the node through node_client, which imports nothing of MPI (a worker is no MPI process)."""
    import pytest

    pytest.importorskip("torch", reason="torch is not installed (scripts/setup installs torch==2.13.0+cpu)")
    dest = tmp_path / "ds"
    pack(make_tree(tmp_path / "src"), dest, PackOptions(codec="zstd:3"))
    read = (f"from fanstore.torch import FileDataset\n"
            f"assert FileDataset({str(dest)!r}, paths=['labels.txt'])[0].startswith(b'train/x/img_000.png')\n")
    unwanted = ("fanstore.pack", "fanstore.pack.compress", "selector", "fanstore.serve", "mpi4py")
    assert loaded(fresh_modules(read), unwanted) == []
    client = fresh_modules("import fanstore.serve.node_client")
    assert loaded(client, ("mpi4py", "fanstore.serve.transport", "fanstore.serve.node")) == []
    for path in sorted((REPO / "fanstore" / "torch").glob("*.py")):
        serving = loaded(imported_names(path), ("fanstore.serve",))
        assert set(serving) <= {"fanstore.serve", "fanstore.serve.node_client",
                                "fanstore.serve.node_client.open_served_dataset"}, path.relative_to(REPO)


def test_the_read_core_imports_no_other_role():
    # The core is what every reader loads (the API, the mount, a DataLoader worker, a serve rank): nothing of the
    # packer, the mount, the serving layer, the demo, FUSE or MPI may come with it, not even inside a function.
    for name, path in fanstore_modules():
        if name.startswith("fanstore.core."):
            unwanted = loaded(imported_names(path), NOT_FOR_THE_CORE)
            assert unwanted == [], f"{path.relative_to(REPO)} imports {unwanted}"


def test_the_top_level_shows_the_roles():
    # Whoever opens fanstore/ sees its packages by role, beside a few modules: the public API, the errors, the CLI.
    top_level = sorted(path.name for path in (REPO / "fanstore").glob("*.py"))
    assert len(top_level) <= MOST_TOP_LEVEL_MODULES, top_level
    for folder in sorted(path for path in (REPO / "fanstore").iterdir() if path.is_dir() and any(path.glob("*.py"))):
        assert (folder / "__init__.py").is_file(), f"{folder.relative_to(REPO)} is not a package"
