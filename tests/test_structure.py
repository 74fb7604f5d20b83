"""The tree's structure: each item of the artifact vocabulary is defined once (tlaloc_jax/artifact/vocabulary.py),
no module of tlaloc_jax.* takes part in an import cycle (counting the imports inside functions and type-only ones),
no module is over MAX_MODULE_LINES lines, one class hands out pool units, the C kernels' sources live in the
top-level kernels/ folder only, which every wheel carries, and no bench edits sys.path (each runs as
`python -m bench.NAME`, imports and the maintained ones answer --help). Names and homes: the modules only the HTTP
server uses live in serve/openai/, no two modules share a name (past SHARED_NAMES), nothing in the library imports
the tools (tlaloc_jax/tools/), and pyproject lists every package folder.

They read the source as text (ast), so they see every file, imported or not. Controls: each detector finds a
second definition planted in a temporary file, the cycle finder a cycle planted in a temporary package, and the
sys.path check the edits planted in a temporary file."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from tlaloc_jax import artifact as af
from tlaloc_jax import serve

ROOT = Path(__file__).resolve().parent.parent
VOCABULARY = "tlaloc_jax/artifact/vocabulary.py"


# -- one definition of each vocabulary item -------------------------------------------------------------------


def _strings(node: ast.AST) -> list[str]:
    """The string items of a collection literal (a dict's keys)."""
    items = node.keys if isinstance(node, ast.Dict) else node.elts
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def _names_most_of(node: ast.AST, names: set[str], least: int) -> bool:
    """A literal that lists at least `least` of `names`, and they are at least half of what it lists."""
    strings = _strings(node)
    hits = {s for s in strings if s in names}
    return len(hits) >= least and 2 * len(hits) >= len(strings)


def _is_mask_width(node: ast.AST) -> bool:
    """(v + 31) // 32, -(-v // 32), (v + 31) >> 5, or ceil(v / 32)."""
    if isinstance(node, ast.BinOp) and isinstance(node.right, ast.Constant):
        left = node.left
        if isinstance(node.op, ast.FloorDiv) and node.right.value == 32:
            return (isinstance(left, ast.BinOp) and isinstance(left.op, ast.Add)
                    and isinstance(left.right, ast.Constant) and left.right.value == 31) or (
                isinstance(left, ast.UnaryOp) and isinstance(left.op, ast.USub))
        if isinstance(node.op, ast.RShift) and node.right.value == 5:
            return isinstance(left, ast.BinOp) and isinstance(left.right, ast.Constant) and left.right.value == 31
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "ceil":
        arg = node.args[0] if node.args else None
        return (isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Div) and isinstance(arg.right, ast.Constant)
                and arg.right.value == 32)
    return False


def vocabulary_definitions(path: Path, rel: str) -> list[tuple[str, str]]:
    """(item, "file:line") for each place in a Python file that defines a vocabulary item: the sampling columns
    or their neutral values (a literal listing all the columns, or all but one: a table of request fields that
    shares a few of their names is not their copy), the quantization scheme names (a literal, or a class body,
    with two or more of them), the packed mask's width."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    columns, schemes = set(af.SAMPLING_COLUMNS), {s.value for s in af.QuantScheme}
    found = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            if _names_most_of(node, columns, len(columns) - 1):
                found.append(("sampling columns", where))
            if _names_most_of(node, schemes, 2):
                found.append(("quantization schemes", where))
        elif isinstance(node, ast.ClassDef):
            values = [s.value.value for s in node.body if isinstance(s, ast.Assign)
                      and isinstance(s.value, ast.Constant) and s.value.value in schemes]
            if len(values) >= 2:
                found.append(("quantization schemes", where))
        elif _is_mask_width(node):
            found.append(("mask width", where))
    return found


def _files(*patterns: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [f for f in out if (ROOT / f).is_file()]


def _python_files() -> list[str]:
    return _files("*.py")


def test_each_vocabulary_item_is_defined_once():
    files = _python_files()
    assert VOCABULARY in files and "serve/host_sampling.py" in files and len(files) > 100
    found: dict[str, list[str]] = {}
    for rel in files:
        for item, where in vocabulary_definitions(ROOT / rel, rel):
            found.setdefault(item, []).append(where)
    assert set(found) == {"sampling columns", "quantization schemes", "mask width"}, found
    for item, places in found.items():
        assert len(places) == 1 and places[0].startswith(VOCABULARY + ":"), (item, places)


def test_the_detectors_find_a_planted_second_definition(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("""
COLUMNS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "top_logprobs")
NEUTRAL = {"temperature": 0.0, "top_p": 1.0, "top_k": 0.0, "min_p": 0.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0, "repetition_penalty": 1.0}
SCHEMES = ["none", "int8", "int4"]
class Scheme:
    A = "int8"
    B = "fp8"
def words(vocab):
    return (vocab + 31) // 32, -(-vocab // 32), math.ceil(vocab / 32), (vocab + 31) >> 5
""")
    found = vocabulary_definitions(planted, "planted.py")
    assert [item for item, _ in found].count("sampling columns") == 2
    assert [item for item, _ in found].count("quantization schemes") == 2
    assert [item for item, _ in found].count("mask width") == 4
    # Uses of the one definition, and a request's field table that names some columns, are not definitions.
    uses = tmp_path / "uses.py"
    uses.write_text("""
row = [SAMPLING_NEUTRAL[c] for c in SAMPLING_COLUMNS]
width = mask_words(vocab)
FIELDS = ("model", "prompt", "max_tokens", "n", "stop", "stream", "seed", "temperature", "top_p", "top_k")
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
scheme = "int8" if quantized else "none"
""")
    assert vocabulary_definitions(uses, "uses.py") == []


# -- no import cycle ----------------------------------------------------------------------------------------------


def project_modules(root: Path, package_dir: dict[str, str]) -> dict[str, Path]:
    """{module name: file} of every module the installed packages hold (pyproject's package-dir mapping)."""
    modules = {}
    for package, folder in package_dir.items():
        base = root / folder
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file (functions and TYPE_CHECKING blocks included: a
    type-only import couples two modules as much as any).
    `from package import x` is an import of package.x when that is a module, else of the package; importing a
    module does not count as importing its parent packages."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target:
                    out.add(target)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    out.add(sub)
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def import_graph(root: Path, package_dir: dict[str, str]) -> dict[str, set[str]]:
    modules = project_modules(root, package_dir)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_no_module_of_tlaloc_jax_is_in_an_import_cycle():
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    graph = import_graph(ROOT, package_dir)
    assert {"tlaloc_jax.artifact.vocabulary", "tlaloc_jax.kernels.in_body_sampler", "tlaloc_jax.export._stage",
            "tlaloc_jax.serve.engine"} <= set(graph)
    assert "tlaloc_jax.artifact" in graph["tlaloc_jax.kernels.in_body_sampler"]
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_planted_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import B\n")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("B = 1\ndef f():\n    from ..a import x   # inside a function: still an edge\n")
    (pkg / "c.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from . import a\n")
    graph = import_graph(tmp_path, {"pkg": "pkg"})
    assert graph["pkg.sub"] == {"pkg.sub.b"} and graph["pkg.c"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b"]]


# -- names and homes: one module a name, the HTTP server's modules in serve/openai/ ---------------------------------

# Names two modules still share: the facades that keep documented import paths (`tlaloc_jax.serve.ray:app`,
# `python -m tlaloc_jax.serve.triton`) over serve/integrations/, and pairs of the artifact and export packages.
SHARED_NAMES = {"config", "errors", "files", "inputs", "mesh", "ray", "triton"}


def shared_module_names(modules: dict[str, Path]) -> set[str]:
    """The module names (a leading underscore dropped) that more than one module of the packages has."""
    stems = [name.rpartition(".")[2].lstrip("_") for name, path in modules.items() if path.stem != "__init__"]
    return {s for s in stems if stems.count(s) > 1 and s != "main__"}


def test_no_two_modules_share_a_name():
    """A name says what a module holds: the host sampler and the in-body sampler are not both `sampling`."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules = project_modules(ROOT, package_dir)
    assert {"tlaloc_jax.serve.engine", "tlaloc_jax.export._stage"} <= set(modules)
    assert shared_module_names(modules) == SHARED_NAMES


def test_the_name_check_finds_a_planted_pair(tmp_path):
    for rel in ("pkg/__init__.py", "pkg/sub/__init__.py", "pkg/sampling.py", "pkg/sub/_sampling.py", "pkg/__main__.py",
                "pkg/sub/__main__.py", "pkg/engine.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert shared_module_names(project_modules(tmp_path, {"pkg": "pkg"})) == {"sampling"}


HTTP_SERVER = ("tlaloc_jax.serve.openai", "tlaloc_jax.serve.http", "tlaloc_jax.serve.__main__")


def http_only_modules(graph: dict[str, set[str]], public: set[str], package: str = "tlaloc_jax.serve") -> list[str]:
    """The modules directly in serve/ that only the HTTP server imports (serve/openai/, the http facade and the
    command line, or another such module): they belong in serve/openai/. `public`: modules whose names the serve
    package exports to users (`tlaloc_jax.serve.BoundedProgram`), which serve more than the server."""
    http = {m for m in graph if m.startswith(HTTP_SERVER)}
    top = {m for m in graph if m.rpartition(".")[0] == package and m not in http | public}
    found: set[str] = set()
    while True:
        more = {m for m in top - found if (users := {u for u, deps in graph.items() if m in deps})
                and users <= http | found}
        if not more:
            return sorted(found)
        found |= more


def test_modules_only_the_http_server_uses_live_in_serve_openai():
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    graph = import_graph(ROOT, package_dir)
    assert "tlaloc_jax.serve.openai.app" in graph and "tlaloc_jax.serve.metrics" in graph
    public = {"tlaloc_jax.serve" + module for module in serve._EXPORTS.values()}
    assert "tlaloc_jax.serve.engine" in public
    assert http_only_modules(graph, public) == []


def test_the_home_check_finds_a_module_only_the_http_server_uses():
    graph = {"tlaloc_jax.serve.openai.app": {"tlaloc_jax.serve.grammar", "tlaloc_jax.serve.metrics"},
             "tlaloc_jax.serve.grammar": {"tlaloc_jax.serve.words"},     # only grammar (itself HTTP-only) uses words
             "tlaloc_jax.serve.words": set(), "tlaloc_jax.serve.loop": {"tlaloc_jax.serve.metrics"},
             "tlaloc_jax.serve.metrics": set(), "tlaloc_jax.serve.unused": set()}
    assert http_only_modules(graph, set()) == ["tlaloc_jax.serve.grammar", "tlaloc_jax.serve.words"]
    assert http_only_modules(graph, {"tlaloc_jax.serve.grammar"}) == []      # a public module, and what only it uses


TOOLS = "tlaloc_jax.tools"


def tool_importers(graph: dict[str, set[str]]) -> list[str]:
    """The modules outside tlaloc_jax.tools that import one of its modules: the tools sit above the library."""
    def is_tool(m: str) -> bool:
        return m == TOOLS or m.startswith(TOOLS + ".")

    return sorted(m for m, deps in graph.items() if not is_tool(m) and any(is_tool(d) for d in deps))


def test_nothing_in_the_library_imports_the_tools():
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    graph = import_graph(ROOT, package_dir)
    assert {"tlaloc_jax.tools.demo", "tlaloc_jax.tools.train", "tlaloc_jax.tools.quality"} <= set(graph)
    assert tool_importers(graph) == []


def test_the_tools_check_finds_an_importer():
    graph = {"tlaloc_jax.export.__main__": {"tlaloc_jax.tools.demo"}, "tlaloc_jax.toolsmith": {"tlaloc_jax.tools"},
             "tlaloc_jax.tools.train": {"tlaloc_jax.tools.demo"}, "tlaloc_jax.tools.demo": {"tlaloc_jax.export"}}
    assert tool_importers(graph) == ["tlaloc_jax.export.__main__", "tlaloc_jax.toolsmith"]


def test_every_package_folder_is_listed_in_pyproject():
    """setuptools ships only the packages pyproject lists: a new subpackage left out is missing from the wheel."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for package, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join([package, *init.parent.relative_to(ROOT / folder).parts]))
    assert "tlaloc_jax.serve.openai" in found
    assert sorted(found - set(setuptools["packages"])) == []


# -- no folder on sys.path shadows an installed package ------------------------------------------------------------


def shadowing(folder: Path, installed: dict[str, list[str]], own: set[str]) -> list[str]:
    """The importable names `folder` holds (packages with an __init__.py, modules) that some installed distribution
    other than `own` also provides: with `folder` first on sys.path (`python -m` from the checkout puts the working
    directory there, pytest puts tests/), an import of that name would load the folder's copy."""
    names = {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()} | {p.stem for p in folder.glob("*.py")}
    return sorted(n for n in names if set(installed.get(n, ())) - own)


def test_no_folder_of_the_checkout_shadows_an_installed_package():
    """transformers imports Hugging Face's `kernels` when installed; a top-level kernels/ once took its place."""
    import importlib.metadata as md

    installed = md.packages_distributions()
    own = {tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]}
    assert "numpy" in installed and "transformers" in installed
    pythonpath = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["pythonpath"]
    folders = [ROOT, ROOT / "tests", *(ROOT / f for f in pythonpath)]     # pytest puts each on sys.path
    assert "tests/support" in pythonpath and all(f.is_dir() for f in folders)
    assert {f.name: shadowing(f, installed, own) for f in folders} == {f.name: [] for f in folders}


def test_the_shadowing_check_finds_a_planted_folder(tmp_path):
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text("")
    (tmp_path / "yaml.py").write_text("")
    (tmp_path / "tlaloc_jax").mkdir()
    (tmp_path / "tlaloc_jax" / "__init__.py").write_text("")
    (tmp_path / "notes").mkdir()    # a folder without __init__.py is at most a namespace portion: never shadows
    installed = {"numpy": ["numpy"], "yaml": ["PyYAML"], "tlaloc_jax": ["tlaloc-jax"], "notes": ["notes"]}
    assert shadowing(tmp_path, installed, {"tlaloc-jax"}) == ["numpy", "yaml"]


# -- modules of one job: none over MAX_MODULE_LINES lines ---------------------------------------------------------

MAX_MODULE_LINES = 500
SIZED_FOLDERS = ("tlaloc_jax/", "serve/", "export/")


def long_modules(files: list[str], root: Path, most: int = MAX_MODULE_LINES) -> list[tuple[str, int]]:
    """(file, lines) of each Python file under SIZED_FOLDERS longer than `most` lines."""
    out = []
    for rel in files:
        if rel.startswith(SIZED_FOLDERS):
            n = len((root / rel).read_text(encoding="utf-8").splitlines())
            if n > most:
                out.append((rel, n))
    return out


def test_no_module_of_the_packages_is_over_the_size_limit():
    files = _python_files()
    assert "serve/engine.py" in files and "tlaloc_jax/decoder.py" in files
    assert long_modules(files, ROOT) == []


def test_the_size_check_finds_a_long_module(tmp_path):
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "serve" / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "long.py").write_text("x = 1\n" * 2000)     # tests are not sized
    files = ["serve/long.py", "serve/short.py", "tests/long.py"]
    assert long_modules(files, tmp_path) == [("serve/long.py", MAX_MODULE_LINES + 1)]


# -- one page allocator ------------------------------------------------------------------------------------------

ALLOCATOR = "serve/core/kv_cache.py:UnitPool"


def allocators(path: Path, rel: str) -> list[str]:
    """"file:Class" for each class that hands out and takes back units (a method named take or alloc, and one named
    release or free)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
            if methods & {"take", "alloc", "allocate"} and methods & {"release", "free"}:
                out.append(f"{rel}:{node.name}")
    return out


def test_one_class_hands_out_pool_units():
    found = [a for rel in _python_files() if rel.startswith(SIZED_FOLDERS) for a in allocators(ROOT / rel, rel)]
    assert found == [ALLOCATOR]


def test_the_allocator_check_finds_a_second_allocator(tmp_path):
    (tmp_path / "planted.py").write_text("class Pages:\n    def alloc(self, n): ...\n    def free(self, p): ...\n"
                                         "class Ring:\n    def take(self, n): ...\n    def give_back(self, p): ...\n")
    assert allocators(tmp_path / "planted.py", "planted.py") == ["planted.py:Pages"]


# -- the C kernels: sources in kernels/ only, and shipped -------------------------------------------------------------

C_SUFFIXES = (".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh")


def misplaced_c_sources(files: list[str]) -> list[str]:
    """The C, C++ and CUDA sources and headers among `files` that are not directly in kernels/ (the one folder
    pyproject ships them from, and that tlaloc_jax.native builds from)."""
    return sorted(f for f in files if f.endswith(C_SUFFIXES) and Path(f).parent != Path("kernels"))


def test_c_sources_live_only_in_kernels():
    files = _files()
    assert {"kernels/decode_attention.c", "kernels/xla_ffi_c_api.h"} <= set(files)
    assert misplaced_c_sources(files) == []
    assert not [f for f in files if f.startswith("kernels/") and f.endswith(".py")]     # a folder, not a package


def test_misplaced_c_sources_are_found():
    files = ["kernels/a.c", "kernels/b.h", "tlaloc_jax/native/a.c", "bench/x.cu", "kernels/sub/y.cpp", "docs/a.md"]
    assert misplaced_c_sources(files) == ["bench/x.cu", "kernels/sub/y.cpp", "tlaloc_jax/native/a.c"]


def test_the_wheel_carries_every_kernel_file():
    """pyproject maps kernels/ to a package whose package-data takes each of its files; a checkout builds from it."""
    from fnmatch import fnmatch

    from tlaloc_jax import native

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    [package] = [p for p, folder in setuptools["package-dir"].items() if folder == "kernels"]
    assert package in setuptools["packages"]
    patterns = setuptools["package-data"][package]
    files = [Path(f).name for f in _files("kernels/")]
    assert set(native.KERNELS.values()) <= set(files)
    assert [f for f in files if not any(fnmatch(f, p) for p in patterns)] == []
    assert native.SOURCES == ROOT / "kernels"


# -- bench/: run as `python -m bench.NAME`, no sys.path edits --------------------------------------------------------

# The benches kept up to date; each must import and answer --help (the others must at least import).
MAINTAINED_BENCHES = ("decode", "peers", "serving", "start", "gpu", "layout")


def sys_path_edits(path: Path) -> list[int]:
    """Lines of `path` that change sys.path: a call of one of its methods (insert, append, extend, ...), an
    assignment or augmented assignment to it or to a slice of it."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))

    def is_sys_path(node: ast.AST) -> bool:
        while isinstance(node, ast.Subscript):
            node = node.value
        return isinstance(node, ast.Attribute) and node.attr == "path" and \
            isinstance(node.value, ast.Name) and node.value.id == "sys"
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            lines += [node.lineno for t in targets if is_sys_path(t)]
    return sorted(lines)


def test_no_bench_edits_sys_path():
    """A bench imports what it shares from the bench package (bench/common.py), run from the repository root."""
    found = {p.name: sys_path_edits(p) for p in sorted((ROOT / "bench").glob("*.py"))}
    assert {name: lines for name, lines in found.items() if lines} == {}
    assert len(found) > len(MAINTAINED_BENCHES)


def test_the_sys_path_check_finds_planted_edits(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import sys\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\nsys.path += ['z']\n"
                       "paths = [*sys.path]\nsys.path.index('x')\n")
    # the read (line 5) is not an edit; a method call counts, whatever it does (line 6)
    assert sys_path_edits(planted) == [2, 3, 4, 6]


def test_every_bench_imports_and_the_maintained_ones_answer_help():
    names = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module('bench.' + n)\n"
    done = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {name: subprocess.Popen([sys.executable, "-m", f"bench.{name}", "--help"], cwd=ROOT, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name in MAINTAINED_BENCHES}
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.startswith("usage:"), (name, err[-3000:])
