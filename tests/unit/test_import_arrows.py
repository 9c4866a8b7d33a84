"""The import arrows of docs/architecture.md, checked: who may import whom.

Every `import` and `from ... import` in `mmserve/` and `preprocess/` counts, including imports
inside functions and under `if TYPE_CHECKING:` (a type-only import is still an arrow a reader
follows). A module's layer is its first package below `mmserve` (or `mmserve.<module>` for the
top-level modules); each layer may import only the layers listed for it in `ALLOWED`. No module
may reach itself again through its imports (no cycles, between modules or between layers), and
the configuration and message leaves import no torch: the API server and the scheduler never
pay for it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LEAVES = {
    "mmserve.config",
    "mmserve.host_cpu",  # the CPU's flags and vendor as every path choice sees them
    "mmserve.device_probe",  # whether the engine will run on CUDA, asked without torch
    "mmserve.model_config",
    "mmserve.model_folder",
    "mmserve.envs",
    "mmserve.protocol",
    "mmserve.sampling_params",
    "mmserve.outputs",
    "mmserve.process_name",  # names the process for ps/top (Linux prctl)
    "mmserve.openmp_env",  # OpenMP wait settings of the processes that run the model
}
# A model family's description (config, multimodal processing, positions: no torch) and the
# registry and interface that reach it, which the API server and the configuration use; the
# rest of mmserve.models (modules, loader) is for workers.
MODEL_DESCRIPTIONS = {"registry", "family", "config", "processing", "positions"}
# Support packages every layer may use is not a thing: only those named below.
ALLOWED: dict[str, set[str]] = {
    **{leaf: LEAVES for leaf in LEAVES},
    "preprocess": set(),
    # builds EngineConfig from the user's flat arguments, the model's slice by its family
    "mmserve.engine_args": LEAVES | {"mmserve.models"},
    "mmserve": LEAVES | {"mmserve.entrypoints"},  # the package's lazy `LLM` export
    "mmserve.core": LEAVES,
    # Structured outputs (xgrammar): the frontend checks specs with it, the engine wiring hands
    # its manager to the scheduler, which sees only core.grammar's interface.
    "mmserve.structured_output": LEAVES,
    "mmserve.ops": LEAVES,
    # process groups and collectives (torch.distributed), the executor's broadcast channel
    "mmserve.distributed": LEAVES,
    "mmserve.layers": LEAVES | {"mmserve.ops", "mmserve.distributed"},
    # a family's processing hands the pool its transform's settings
    "mmserve.models": LEAVES | {"mmserve.layers", "mmserve.ops", "mmserve.distributed", "preprocess"},
    "mmserve.worker": LEAVES
    | {"mmserve.core.sched_output", "mmserve.models", "mmserve.layers", "mmserve.ops", "mmserve.distributed"},
    # executors own the workers (in this process, worker processes or Ray actors)
    "mmserve.executor": LEAVES | {"mmserve.core.sched_output", "mmserve.worker", "mmserve.distributed"},
    "mmserve.engine": LEAVES | {"mmserve.core", "mmserve.executor", "mmserve.structured_output"},
    "mmserve.engine_process": LEAVES
    | {"mmserve.engine", "mmserve.core.engine_core", "mmserve.core.sched_output"},
    "mmserve.metrics": LEAVES,
    "mmserve.frontend": LEAVES
    | {
        "preprocess",
        "mmserve.models",  # descriptions only (is_allowed)
        "mmserve.engine_process",
        "mmserve.core.engine_core",
        "mmserve.structured_output",
    },
    "mmserve.entrypoints": LEAVES
    | {"mmserve.engine_args", "mmserve.frontend", "mmserve.engine", "mmserve.metrics"},
    # `mmserve serve|bench`: above the server and the benchmarks, which it starts.
    "mmserve.cli": LEAVES | {"mmserve.engine_args", "mmserve.entrypoints", "mmserve.bench"},
    # Benchmarks and test support drive the engine from outside; nothing above imports them
    # (but the CLI's `bench` command, lazily).
    "mmserve.bench": LEAVES
    | {
        "mmserve.engine_args",
        "mmserve.entrypoints",
        "mmserve.frontend",
        "mmserve.testing",
        "mmserve.worker",
        "mmserve.metrics",
    },
    "mmserve.testing": LEAVES
    | {
        "mmserve.engine_args",
        "mmserve.entrypoints",
        "mmserve.frontend",
        "mmserve.core",
        "mmserve.worker",
        "mmserve.engine",
    },
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "preprocess":
        return "preprocess"
    if len(parts) == 1:
        return "mmserve"
    return f"mmserve.{parts[1]}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str, root: Path) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(path: Path, module: str, root: Path) -> set[str]:
    """Absolute names of the project modules `path` imports (relative imports resolved;
    `from package import module` names the module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            members = [f"{target}.{alias.name}" for alias in node.names]
            submodules = [name for name in members if is_module(name, root)]
            found.update(submodules or [target])
    return {name for name in found if name.split(".")[0] in ("mmserve", "preprocess")}


# Imported by the API server and the scheduler: torch may not be among their imports.
TORCH_FREE = ("mmserve.config", "mmserve.model_config", "mmserve.engine_args", "mmserve.protocol")


def is_model_description(module: str) -> bool:
    """A torch-free module of mmserve.models: the registry, the interface, a family's description."""
    parts = module.split(".")
    return parts[:2] == ["mmserve", "models"] and parts[-1] in MODEL_DESCRIPTIONS


def is_allowed(source: str, target: str) -> bool:
    source_layer, target_layer = layer_of(source), layer_of(target)
    if source_layer == target_layer:
        return True
    if target_layer == "mmserve.models" and source_layer in ("mmserve.frontend", "mmserve.engine_args"):
        return is_model_description(target)
    return any(target == allowed or target.startswith(allowed + ".") for allowed in ALLOWED[source_layer])


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module → the project modules it imports, for every module under `root`."""
    graph = {}
    for package in ("mmserve", "preprocess"):
        for path in sorted((root / package).rglob("*.py")):
            source = module_name(path, root)
            graph[source] = imported_modules(path, source, root)
    return graph


def forbidden_imports(root: Path) -> list[str]:
    """'source -> target' for every import that breaks the arrows, under `root`."""
    broken = []
    for source, targets in import_graph(root).items():
        if layer_of(source) not in ALLOWED:
            broken.append(f"{source}: layer {layer_of(source)} is not on the map")
            continue
        broken += [f"{source} -> {target}" for target in sorted(targets) if not is_allowed(source, target)]
    return broken


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (each a cycle or several), each
    sorted; iterative Tarjan, so deep import chains cannot overflow the stack."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def layer_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Layer → the other layers its modules import."""
    layers: dict[str, set[str]] = {}
    for source, targets in graph.items():
        layers.setdefault(layer_of(source), set()).update(
            layer_of(t) for t in targets if layer_of(t) != layer_of(source)
        )
    return layers


def torch_imports(root: Path, modules: Iterable[str]) -> list[str]:
    """Those of `modules` whose source imports torch (anywhere in the file)."""
    importers = []
    for module in modules:
        tree = ast.parse((root / (module.replace(".", "/") + ".py")).read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            if any(name == "torch" or name.startswith("torch.") for name in names):
                importers.append(module)
                break
    return importers


def test_no_import_breaks_the_arrows():
    assert forbidden_imports(ROOT) == []


def test_no_module_imports_itself_again():
    graph = import_graph(ROOT)
    assert cycles(graph) == []
    assert cycles(layer_graph(graph)) == []


def test_the_configuration_leaves_import_no_torch():
    assert torch_imports(ROOT, TORCH_FREE) == []


def test_the_scheduler_and_the_frontend_load_without_torch():
    """What the API server and EngineCore's scheduling side import, in a fresh interpreter."""
    modules = [
        "mmserve.core.scheduler",
        "mmserve.core.engine_core",
        "mmserve.engine_args",
        "mmserve.frontend.factory",
        "mmserve.frontend.async_llm",
        "mmserve.entrypoints.openai.api_server",
    ]
    script = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_a_planted_cycle_is_caught(tmp_path):
    """The checker itself: two frontend modules importing each other (one only for typing)."""
    _write_tree(
        tmp_path,
        {
            "mmserve/__init__.py": "",
            "mmserve/frontend/__init__.py": "",
            "mmserve/frontend/a.py": "from mmserve.frontend.b import B\n",
            "mmserve/frontend/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from mmserve.frontend.a import A\n",
            "mmserve/frontend/c.py": "from mmserve.frontend.a import A\n",
        },
    )
    assert cycles(import_graph(tmp_path)) == [["mmserve.frontend.a", "mmserve.frontend.b"]]


def test_a_planted_layer_cycle_is_caught():
    graph = {
        "mmserve.entrypoints.cli": {"mmserve.bench.serve"},
        "mmserve.bench.step_profile": {"mmserve.entrypoints.llm"},
    }
    assert cycles(layer_graph(graph)) == [["mmserve.bench", "mmserve.entrypoints"]]


def test_a_planted_torch_import_is_caught(tmp_path):
    _write_tree(tmp_path, {"mmserve/config.py": "import dataclasses\n\ndef f():\n    from torch import nn\n"})
    assert torch_imports(tmp_path, ["mmserve.config"]) == ["mmserve.config"]


def test_a_forbidden_import_is_caught(tmp_path):
    """The checker itself: an upward import planted in a copy of the layout is reported."""
    for name, text in {
        "mmserve/__init__.py": "",
        "mmserve/config.py": "",
        "mmserve/core/__init__.py": "",
        "mmserve/core/scheduler.py": (
            "from mmserve.config import X\nfrom mmserve.worker.model_runner import Y\n"
        ),
        "mmserve/worker/__init__.py": "",
        "mmserve/worker/model_runner.py": "from ..core.sched_output import SchedulerOutput\n",
        "preprocess/__init__.py": "def f():\n    import mmserve.envs\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert forbidden_imports(tmp_path) == [
        "mmserve.core.scheduler -> mmserve.worker.model_runner",
        "preprocess -> mmserve.envs",
    ]
