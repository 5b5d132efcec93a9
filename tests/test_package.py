"""The package: layers that import one way, settings taken on import, console scripts."""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Checkout folder -> installed package, lowest layer first. A module may import its own layer
# and the layers listed before it, never one after it.
LAYERS = [("poecaps", "poecaps"), ("trainers", "poecaps.trainers"), ("samplers", "poecaps.samplers"),
          ("experiments", "poecaps.experiments")]
ABOVE_THE_LIBRARY = ("trainers", "samplers", "experiments", "scripts")


def _modules(folder, package):
    """`{module name: path}` of every .py file under the checkout folder of `package`."""
    found = {}
    top = os.path.join(ROOT, folder)
    for directory, _, files in os.walk(top):
        for name in files:
            if name.endswith(".py"):
                parts = os.path.relpath(os.path.join(directory, name), top)[:-3].split(os.sep)
                parts = parts[:-1] if parts[-1] == "__init__" else parts
                found[".".join([package, *parts])] = os.path.join(directory, name)
    return found


def _imports(path, module):
    """Absolute names of the modules `path` imports (relative imports resolved against `module`)."""
    names = set()
    with open(path) as handle:
        tree = ast.parse(handle.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.split(".")[:-node.level] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _layer_of(name):
    """Index in LAYERS of the layer a module name belongs to (checkout or installed name), or None."""
    for index in reversed(range(len(LAYERS))):
        folder, package = LAYERS[index]
        if name == package or name.startswith(package + ".") or (
                index and (name == folder or name.startswith(folder + "."))):
            return index
    return None


def test_every_module_imports_only_its_own_layer_and_those_below():
    violations = []
    for index, (folder, package) in enumerate(LAYERS):
        for module, path in _modules(folder, package).items():
            for name in _imports(path, module):
                if name.split(".")[0] in ("scripts", "tests", "bench"):
                    violations.append((module, name))
                layer = _layer_of(name)
                if layer is not None and layer > index:
                    violations.append((module, name))
                if index and name.split(".")[0] == folder:
                    violations.append((module, name + " (use the installed name)"))
    assert not violations


def test_no_two_modules_import_each_other():
    graph = {}
    for folder, package in LAYERS:
        for module, path in _modules(folder, package).items():
            graph[module] = {n for n in _imports(path, module) if _layer_of(n) is not None} - {module}
    # imports of a package's submodule count as imports of the module itself
    modules = set(graph)
    edges = {m: {n if n in modules else n.rsplit(".", 1)[0] for n in deps} & modules
             for m, deps in graph.items()}
    cycles = sorted((a, b) for a in edges for b in edges[a] if a in edges.get(b, ()) and a < b
                    and not (a.startswith(b + ".") or b.startswith(a + ".")))
    assert not cycles


BLOCKER = """
import importlib, importlib.abc, sys
BLOCKED = {blocked!r}

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"blocked: {{name}}")
        return None

sys.meta_path.insert(0, Blocker())
for name in {modules!r}:
    importlib.import_module(name)
print("imported", len({modules!r}))
"""


def test_the_library_imports_with_every_layer_above_it_unimportable():
    """Every module under poecaps/, in a fresh interpreter where the trainers, samplers,
    experiments and scripts (checkout or installed names) cannot be imported."""
    modules = sorted(_modules("poecaps", "poecaps"))
    blocked = [*ABOVE_THE_LIBRARY, *(package for _, package in LAYERS[1:])]
    code = BLOCKER.format(blocked=blocked, modules=modules)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"imported {len(modules)}" in result.stdout


@pytest.mark.parametrize("value, expected", [(None, "true"), ("false", "false"), ("true", "true")])
def test_importing_poecaps_selects_the_bfc_cpu_allocator_unless_told_otherwise(value, expected):
    """`import poecaps` sets TF_CPU_ALLOCATOR_USE_BFC=true for TensorFlow, and keeps a value the
    user set (what TensorFlow then does with it is TensorFlow's business)."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    if value is not None:
        env["TF_CPU_ALLOCATOR_USE_BFC"] = value
    code = "import os, poecaps; print(os.environ['TF_CPU_ALLOCATOR_USE_BFC'])"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120, check=True)
    assert result.stdout.split()[-1] == expected


def test_console_scripts_are_the_scripts_functions():
    """pyproject's entry points name the functions `scripts/*.py` call, and they answer --help."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        entry_points = tomllib.load(handle)["project"]["scripts"]
    for command, target in entry_points.items():
        module, function = target.split(":")
        script = os.path.join(ROOT, "scripts", function + ".py")
        with open(script) as handle:
            assert f"from {module} import {function}" in handle.read(), command
        result = subprocess.run([sys.executable, "-c", f"from {module} import {function}; {function}(['--help'])"],
                                capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0 and "usage:" in result.stdout, result.stderr[-1000:]


def test_an_install_claims_only_the_name_poecaps():
    """Every installed package is poecaps or under it, and each maps to a folder of the checkout."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        setuptools = tomllib.load(handle)["tool"]["setuptools"]
    assert all(p == "poecaps" or p.startswith("poecaps.") for p in setuptools["packages"])
    for package, folder in setuptools["package-dir"].items():
        assert package.split(".")[0] == "poecaps" and os.path.isfile(os.path.join(ROOT, folder, "__init__.py"))
    # every folder with Python modules is packaged, so that nothing is left out of an install
    packaged = {package for package in setuptools["packages"]}
    for folder, package in LAYERS:
        for module in _modules(folder, package):
            parent = module if module in packaged else module.rsplit(".", 1)[0]
            assert parent in packaged, module


def test_the_version_is_the_one_pyproject_declares():
    """`poecaps.__version__`, which every run's `environment.jsonl` records, is the packaged version."""
    import tomllib

    import poecaps

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        assert poecaps.__version__ == tomllib.load(handle)["project"]["version"]


def test_a_run_names_the_poecaps_checkout_it_ran_from_and_no_other_repository(tmp_path):
    """`environment._git_commit`: a checkout's HEAD (`-dirty` with changes); None for a package folder that
    another repository holds, as a virtual environment inside a project's checkout would."""
    from poecaps.experiments.environment import _git_commit

    git = lambda *args: subprocess.run(["git", "-C", str(tmp_path / "checkout"), *args], check=True,
                                       capture_output=True, text=True).stdout.strip()
    package = tmp_path / "checkout" / "poecaps"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = git("log", "-1", "--format=%H")
    assert len(head) == 40 and _git_commit(str(package)) == head
    (package / "__init__.py").write_text("x = 1\n")
    assert _git_commit(str(package)) == head + "-dirty"
    installed = tmp_path / "checkout" / "venv" / "site-packages" / "poecaps"
    installed.mkdir(parents=True)
    assert _git_commit(str(installed)) is None
    assert _git_commit(str(tmp_path)) is None                      # no repository at all


def test_a_run_records_the_cpus_identity_from_cpuinfo(tmp_path):
    """`environment.cpu` reads the first processor's block: its name, its vendor, family, model and stepping,
    and the kernel-relevant flags only; a missing file leaves the identity unknown."""
    from poecaps.experiments.environment import cpu

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                       "model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx_vnni\n\n"
                       "processor\t: 1\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nflags\t\t: fpu amx_tile\n")
    assert cpu(str(cpuinfo)) == ("AMD EPYC", "AuthenticAMD family 26 model 2 stepping 1",
                                  ["avx", "avx2", "avx512f", "avx_vnni", "fma"])
    cpuinfo.write_text("model name\t: Some CPU\nflags\t\t: avx\n")          # no family: no identity
    assert cpu(str(cpuinfo)) == ("Some CPU", None, ["avx"])
    assert cpu(str(tmp_path / "missing"))[1:] == (None, [])
