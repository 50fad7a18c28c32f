"""Packages are layers: coordinator < rollout < trainer < rl < coordinator_cli.

Every module's imports are read from its syntax tree, wherever they stand
(top level, inside functions, `importlib.import_module` with a literal name),
and none may reach a higher layer.  Plugins (action kinds, torchrun's
rendezvous) are found through entry points, never imported by name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("coordinator", "rollout", "trainer", "rl", "coordinator_cli")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else \
                func.id if isinstance(func, ast.Name) else ""
            if name in ("import_module", "__import__") and node.args and \
                    isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def violations() -> list[str]:
    out = []
    for layer, package in enumerate(LAYERS):
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, module in imported_modules(path):
                top = module.split(".")[0]
                if top in LAYERS and LAYERS.index(top) > layer:
                    out.append(f"{path.relative_to(ROOT)}:{line} imports {module} "
                               f"({top} is above {package})")
    return out


def test_no_package_imports_a_higher_layer() -> None:
    assert violations() == []


def test_the_check_sees_imports_inside_functions_and_importlib(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("import os\n"
                      "def f():\n"
                      "    from rl.actions import KIND\n"
                      "    importlib.import_module('trainer.train')\n")
    assert [m for _, m in imported_modules(sample)] == ["os", "rl.actions", "trainer.train"]


def import_graph() -> dict[str, set[str]]:
    """module -> project modules it imports (lazy imports included)."""
    graph: dict[str, set[str]] = {}
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for package in LAYERS for p in (ROOT / package).rglob("*.py")}
    for name in modules:
        path = ROOT / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / name.replace(".", "/") / "__init__.py"
        edges = set()
        for _, module in imported_modules(path):
            while module and module not in modules:
                module = module.rpartition(".")[0]
            if module and module != name and "." in module:
                edges.add(module)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_two_modules_import_each_other_even_lazily() -> None:
    assert cycles(import_graph()) == []


# The RL loop's own rules (rl/schedule.py): the phase machine never names them.
RL_POLICY_NAMES = ("RlPhase", "RolloutSplit", "ScheduleSection", "should_eval", "evaluates",
                   "eval_interval", "eval_before_train", "rollout_split", "rl_phase")


def test_the_rl_loops_policy_names_do_not_appear_in_coordinator() -> None:
    found = [f"{path.relative_to(ROOT)}:{n}: {name}"
             for path in sorted((ROOT / "coordinator").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             for name in RL_POLICY_NAMES if re.search(rf"\b{name}\b", line)]
    assert found == []


def attribute_reads(name: str) -> list[str]:
    out = []
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            out += [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute) and node.attr == name]
    return out


def test_weight_update_is_read_in_one_place_in_rollout() -> None:
    # EngineConfig.update, and its own validation in __post_init__.
    reads = attribute_reads("weight_update")
    assert reads and {r.split(":")[0] for r in reads} == {"rollout/engines/config.py"}, reads


def importers_of(prefix: str) -> set[str]:
    found = set()
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if any(m == prefix or m.startswith(prefix + ".") for _, m in imported_modules(path)):
                found.add(rel)
    return found


def test_sub_packages_are_entered_only_through_their_door() -> None:
    # The CPU server runs as its own process (python -m rollout.hf.server): only
    # the engine that starts it imports it, for the name of its key variable.
    outside = {p for p in importers_of("rollout.hf") if not p.startswith("rollout/hf/")}
    assert outside == {"rollout/engines/hf.py"}
    # Operator tools sit above the protocol: the CLI uses them; of the protocol
    # only runplan does, asking status whether daemons still heartbeat before
    # --new-run archives a run.
    core = {p for p in importers_of("coordinator.ops")
            if p.startswith("coordinator/") and not p.startswith("coordinator/ops/")}
    assert core == {"coordinator/machine/runplan.py"}


# coordinator's wings (coordinator/__init__.py): each imports only the base and the
# wings it stands on.  storage and config stand side by side on records.
WINGS: dict[str, set[str]] = {
    "base": set(),
    "records": {"base"},
    "storage": {"base", "records"},
    "config": {"base", "records"},
    "machine": {"base", "records", "storage", "config"},
    "ops": {"base", "records", "storage", "config", "machine"},
}
BASE = ("coordinator.errors", "coordinator.routing")
# runplan asks status whether daemons still heartbeat before --new-run archives a run.
WING_EXCEPTIONS = {("coordinator.machine.runplan", "coordinator.ops.status")}


def wing_of(module: str) -> str | None:
    if module in BASE or module == "coordinator":
        return "base"
    parts = module.split(".")
    return parts[1] if parts[0] == "coordinator" and len(parts) > 2 else None


def wing_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for name, edges in sorted(graph.items()):
        wing = wing_of(name)
        if wing is None:
            continue
        for target in sorted(edges):
            other = wing_of(target)
            if other is not None and other != wing and other not in WINGS[wing] and \
                    (name, target) not in WING_EXCEPTIONS:
                out.append(f"{name} ({wing}) imports {target} ({other})")
    return out


def test_every_coordinator_module_is_in_a_wing_and_imports_only_those_below() -> None:
    flat = sorted(p.name for p in (ROOT / "coordinator").glob("*.py")
                  if f"coordinator.{p.stem}" not in BASE and p.name != "__init__.py")
    assert flat == [], "a module of coordinator/ outside the base and the wings"
    wings = sorted(p.name for p in (ROOT / "coordinator").iterdir()
                   if (p / "__init__.py").exists())
    assert wings == sorted(set(WINGS) - {"base"})
    for wing in wings:
        doc = ast.get_docstring(ast.parse((ROOT / "coordinator" / wing / "__init__.py").read_text()))
        assert doc and "import" in doc, f"coordinator/{wing}/__init__.py says what it may import"
    assert wing_violations(import_graph()) == []


def test_the_wing_check_sees_a_wing_importing_one_beside_or_above() -> None:
    graph = {"coordinator.storage.fsio": {"coordinator.errors", "coordinator.records.layout",
                                          "coordinator.machine.polling"},
             "coordinator.config.placement": {"coordinator.storage.fsio"},
             "coordinator.errors": {"coordinator.routing"},
             "coordinator.machine.runplan": {"coordinator.ops.status"},
             "rollout.client": {"coordinator.machine.polling"}}
    assert wing_violations(graph) == [
        "coordinator.config.placement (config) imports coordinator.storage.fsio (storage)",
        "coordinator.storage.fsio (storage) imports coordinator.machine.polling (machine)"]
