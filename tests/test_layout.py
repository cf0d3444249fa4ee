"""The layers the folders promise (issue 15): the eBPF machine (runtime/machine) imports only
itself, the standard library and third-party packages, never the simulation or the front end."""
import ast
import sys

from conftest import ROOT

MACHINE = ROOT / "runtime" / "machine"
PROJECT = ("fabric_ext", "codegen", "runtime", "policies")


def imports(path):
    """(line, module) of every import in a file, relative ones resolved inside the machine."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                yield node.lineno, node.module
            elif node.level == 1:
                yield node.lineno, "fabric_ext.runtime.machine" + (f".{node.module}" if node.module else "")
            else:
                yield node.lineno, "." * node.level + (node.module or "")


def test_the_machine_imports_nothing_of_the_simulation_or_the_front_end():
    files = sorted(MACHINE.glob("*.py"))
    assert len(files) >= 15
    bad = []
    for path in files:
        for line, module in imports(path):
            top = module.split(".")[0]
            inside = module == "fabric_ext.runtime.machine" or module.startswith("fabric_ext.runtime.machine.")
            if module.startswith(".") or (top in PROJECT and not inside):
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
            elif top not in PROJECT and top not in sys.stdlib_module_names:
                assert top in ("numpy", "llvmlite"), f"{path.name}:{line}: {module}"
    assert not bad, "\n".join(bad)


def test_the_walk_sees_a_forbidden_import(tmp_path):
    """The walk itself: a relative import that climbs out of the machine is reported."""
    p = tmp_path / "x.py"
    p.write_text("from ..simulation.engine import Engine\nfrom .isa import Insn\n")
    assert list(imports(p)) == [(1, "..simulation.engine"), (2, "fabric_ext.runtime.machine.isa")]


def test_the_machine_imports_point_one_way():
    """No import cycle among the machine's modules (nested imports included): shared pieces
    (faults, ALU semantics, context masks) live in `semantics`, backends are chosen in
    `backends`, and the interfaces in `program` import no backend."""
    import networkx as nx
    g = nx.DiGraph()
    prefix = "fabric_ext.runtime.machine."
    for path in MACHINE.glob("*.py"):
        g.add_node(path.stem)
        for _, module in imports(path):
            if module.startswith(prefix):
                g.add_edge(path.stem, module[len(prefix):].split(".")[0])
            elif module == "fabric_ext.runtime.machine":
                pass                # `from . import isa`: the edge is by name below
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:
                for alias in node.names:
                    g.add_edge(path.stem, alias.name)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, cycles


def test_the_contract_sits_below_both_sides():
    """fabric_ext/contract (catalogue, ids, routing, movement matching, context codec, the
    bundle's format, writer and loader) is what the compiler and the runtime import; it imports
    neither (only units and the machine)."""
    contract = ROOT / "fabric_ext" / "contract"
    bad = []
    for path in sorted(contract.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                module = {1: "fabric_ext.contract", 2: "fabric_ext"}[node.level] + (f".{node.module}" if node.module else "")
            elif isinstance(node, ast.ImportFrom):
                module = node.module
            elif isinstance(node, ast.Import):
                module = node.names[0].name
            else:
                continue
            if module.split(".")[0] in PROJECT and not module.startswith(
                    ("fabric_ext.contract", "fabric_ext.units", "fabric_ext.runtime.machine")):
                bad.append(f"{path.name}:{node.lineno}: imports {module}")
    assert len(list(contract.glob("*.py"))) >= 6 and not bad, bad
