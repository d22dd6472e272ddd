"""The layering stated in contract/__init__.py, read from the source: entry points (`pipelines`) over backends
(`trainers`) over contracts (`contract`); imports only go down, inside functions too, and never in a cycle. A
backend imports no other backend (what they share lives in their framework's shared modules). And the modules a
TensorFlow worker loads import no torch at module level (a run checks the same at runtime:
tests/support/loop_backends.py)."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

LAYERS = {"contract": 0, "trainers": 1, "pipelines": 2}  # a package may import its own layer and those below


def backend_modules() -> dict[str, str]:
    """The module of each registered backend (one per framework where it has several), and its framework."""
    from trainers import BACKENDS

    return {spec.module(framework): framework for spec in BACKENDS.specs.values() for framework in spec.frameworks}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def parsed(source: str, tries: int = 3) -> ast.Module:
    """`ast.parse(source)`, tried again where CPython 3.11 (before 3.11.8) raises its spurious "AST constructor
    recursion depth mismatch" SystemError (python/cpython#106905: a depth count it shares with the interpreter's
    other parses), seen here once after a test had loaded Transformers in this process."""
    for _ in range(tries - 1):
        try:
            return ast.parse(source)
        except SystemError:
            pass
    return ast.parse(source)


def imports(path: Path, module_level_only: bool = False) -> set[str]:
    """Modules `path` imports (skipping `if TYPE_CHECKING:` blocks; only top-level statements if asked)."""
    tree = parsed(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.add(child.module)
                found.update(f"{child.module}.{alias.name}" for alias in child.names)
            inside = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if not (module_level_only and inside):
                visit(child, top and not inside)
    visit(tree, True)
    return found


def sources() -> dict[str, Path]:
    return {module_name(p): p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")}


def test_imports_only_go_down_the_layers():
    backward = []
    for name, path in sources().items():
        own = LAYERS[name.split(".")[0]]
        for imported in imports(path):
            top = imported.split(".")[0]
            if top in LAYERS and LAYERS[top] > own:
                backward.append(f"{name} imports {imported}")
    assert backward == []


def project_imports() -> dict[str, set[str]]:
    """Each module of the layers and the modules of the layers it imports (inside functions too)."""
    modules = sources()
    return {name: {m for m in imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_no_backend_imports_another():
    """What backends share lives in their framework's family modules (adapter.py, backend.py, data.py, ...)."""
    modules, graph = set(backend_modules()), project_imports()
    assert modules <= set(graph), modules - set(graph)
    siblings = [f"{name} imports {other}" for name in modules for other in graph[name] if other in modules]
    assert siblings == []


def test_no_import_cycles():
    graph, cycles = project_imports(), []

    def visit(name: str, path: list[str]) -> None:
        for other in sorted(graph[name]):
            if other in path:
                cycles.append(" -> ".join([*path[path.index(other):], other]))
            elif other not in done:
                visit(other, [*path, other])
        done.add(name)
    done: set[str] = set()
    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    assert cycles == []


def test_tensorflow_workers_import_no_torch():
    modules = sources()
    tensorflow_backends = [module for module, framework in backend_modules().items() if framework == "tf"]
    assert {"trainers.tf.tf_mwms", "trainers.horovod.tf"} <= set(tensorflow_backends)
    seen, todo = set(), [*tensorflow_backends, "trainers.tf.ps.server"]
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        found = imports(modules[name], module_level_only=True)
        assert not {m for m in found if m.split(".")[0] == "torch"}, f"{name} imports torch"
        parents = [".".join(m.split(".")[:i]) for m in found for i in range(1, m.count(".") + 2)]
        todo.extend(p for p in parents if p in modules)
    assert {"trainers.loop", "trainers.tf.adapter", "contract.metrics"} <= seen  # the walk reached them


def test_ray_trains_controller_unpickles_the_backend_configs_without_a_framework():
    """The controller unpickles the trainer's backend config (trainers/torch/process_group.py,
    trainers/tf/tf_config.py); Ray's own `TorchConfig` and `TensorflowConfig` would import torch and TensorFlow
    there. Checked in a fresh interpreter, as the controller's process is."""
    import pickle
    import subprocess
    import sys

    from trainers.tf.tf_config import MirroredConfig
    from trainers.torch.process_group import TorchGroupConfig

    configs = pickle.dumps([TorchGroupConfig(backend="gloo"), MirroredConfig()])
    probe = ("import pickle, sys; torch, mirrored = pickle.loads(sys.stdin.buffer.read()); "
             "assert torch.backend == 'gloo' and torch.backend_cls.__name__ == 'TorchGroupBackend'; "
             "assert mirrored.backend_cls.__name__ == 'MirroredBackend'; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow', 'keras', 'tf_keras')))")
    seen = subprocess.run([sys.executable, "-c", probe], input=configs, capture_output=True, cwd=ROOT, check=True)
    assert seen.stdout.decode().strip() == "[]"


def test_the_parallel_layers_import_no_model():
    """Tensor, pipeline and sharded data parallelism apply a model spec's plans (trainers/models/bert_parallel.py is
    the built-in BERT's): the parallel package knows no model."""
    graph = project_imports()
    found = [f"{name} imports {other}" for name in graph if name.startswith("trainers.torch.parallel")
             for other in graph[name] if other.startswith("trainers.models")]
    assert found == []
    assert "trainers.torch.parallel.layers" in graph  # the walk saw the package
