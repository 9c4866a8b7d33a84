"""The import arrows of docs/architecture.md, checked: who may import whom.

Every `import` and `from ... import` in `mmserve/` and `preprocess/` counts, including imports
inside functions and under `if TYPE_CHECKING:` (a type-only import is still an arrow a reader
follows). A module's layer is its first package below `mmserve` (or `mmserve.<module>` for the
top-level modules); each layer may import only the layers listed for it in `ALLOWED`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LEAVES = {
    "mmserve.config",
    "mmserve.engine_args",  # builds EngineConfig from the user's flat arguments
    "mmserve.model_config",
    "mmserve.model_folder",
    "mmserve.envs",
    "mmserve.protocol",
    "mmserve.sampling_params",
    "mmserve.outputs",
    "mmserve.process_name",  # names the process for ps/top (Linux prctl)
    "mmserve.openmp_env",  # OpenMP wait settings of the processes that run the model
}
# Support packages every layer may use is not a thing: only those named below.
ALLOWED: dict[str, set[str]] = {
    **{leaf: LEAVES for leaf in LEAVES},
    "preprocess": set(),
    "mmserve": LEAVES | {"mmserve.entrypoints"},  # the package's lazy `LLM` export
    "mmserve.core": LEAVES,
    # Structured outputs (xgrammar): the frontend checks specs with it, the engine wiring hands
    # its manager to the scheduler, which sees only core.grammar's interface.
    "mmserve.structured_output": LEAVES,
    "mmserve.ops": LEAVES,
    # process groups and collectives (torch.distributed), the executor's broadcast channel
    "mmserve.distributed": LEAVES,
    "mmserve.layers": LEAVES | {"mmserve.ops", "mmserve.distributed"},
    "mmserve.models": LEAVES | {"mmserve.layers", "mmserve.ops", "mmserve.distributed"},
    "mmserve.worker": LEAVES
    | {"mmserve.core.sched_output", "mmserve.models", "mmserve.layers", "mmserve.ops", "mmserve.distributed"},
    # executors own the workers (in this process, worker processes or Ray actors)
    "mmserve.executor": LEAVES | {"mmserve.core.sched_output", "mmserve.worker", "mmserve.distributed"},
    "mmserve.engine": LEAVES | {"mmserve.core", "mmserve.executor", "mmserve.structured_output"},
    "mmserve.engine_process": LEAVES
    | {"mmserve.engine", "mmserve.core.engine_core", "mmserve.core.sched_output"},
    "mmserve.metrics": LEAVES,
    "mmserve.frontend": LEAVES
    | {"preprocess", "mmserve.engine_process", "mmserve.core.engine_core", "mmserve.structured_output"},
    "mmserve.entrypoints": LEAVES
    | {"mmserve.frontend", "mmserve.engine", "mmserve.metrics", "mmserve.bench"},
    # Benchmarks and test support drive the engine from outside; nothing above imports them
    # (but the CLI's `bench` command, lazily).
    "mmserve.bench": LEAVES
    | {"mmserve.entrypoints", "mmserve.frontend", "mmserve.testing", "mmserve.worker", "mmserve.metrics"},
    "mmserve.testing": LEAVES
    | {"mmserve.entrypoints", "mmserve.frontend", "mmserve.core", "mmserve.worker", "mmserve.engine"},
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


def is_allowed(source: str, target: str) -> bool:
    source_layer, target_layer = layer_of(source), layer_of(target)
    if source_layer == target_layer:
        return True
    return any(target == allowed or target.startswith(allowed + ".") for allowed in ALLOWED[source_layer])


def forbidden_imports(root: Path) -> list[str]:
    """'source -> target' for every import that breaks the arrows, under `root`."""
    broken = []
    for package in ("mmserve", "preprocess"):
        for path in sorted((root / package).rglob("*.py")):
            source = module_name(path, root)
            if layer_of(source) not in ALLOWED:
                broken.append(f"{source}: layer {layer_of(source)} is not on the map")
                continue
            for target in sorted(imported_modules(path, source, root)):
                if not is_allowed(source, target):
                    broken.append(f"{source} -> {target}")
    return broken


def test_no_import_breaks_the_arrows():
    assert forbidden_imports(ROOT) == []


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
