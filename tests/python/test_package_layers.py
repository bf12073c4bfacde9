"""The package's compatibility across its own reorganisations: pickles of optimizers written
by the version with flat modules (pagedoptim.optim.adamw, pagedoptim.paging.options, pagedoptim.integrations.stand_ins;
tests/python/data/make_old_pickles.py) load and keep training."""

from __future__ import annotations

import pathlib
import pickle

import pytest
import torch

import pagedoptim as po

DATA = pathlib.Path(__file__).resolve().parent / "data"
OLD_PICKLES = sorted(DATA.glob("old_pickle_*.pkl"))


def test_the_old_pickles_are_there():
    assert {p.stem for p in OLD_PICKLES} == {
        "old_pickle_adamw_8bit", "old_pickle_sgd_exact", "old_pickle_lion_paged",
        "old_pickle_skewadam", "old_pickle_patched_adamw"}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("path", OLD_PICKLES, ids=lambda p: p.stem)
def test_an_optimizer_pickled_by_the_flat_layout_loads_and_steps(path):
    opt = pickle.loads(path.read_bytes())
    assert isinstance(opt, po.PagedOptimizer)
    params = [p for group in opt.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in params]
    counted = "step" in opt.state[params[0]]  # torch's SGD keeps no step count, nor do we
    assert not counted or {int(opt.state[p]["step"]) for p in params} == {2}
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert not counted or {int(opt.state[p]["step"]) for p in params} == {3}
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))


# -- the layers ----------------------------------------------------------------------------

PACKAGE = pathlib.Path(po.__file__).resolve().parent
# Each layer imports only layers of a lower rank (and itself). integrations/ and reference/
# share a rank and must not import each other: the library never imports its test oracles.
RANKS = {"base": 0, "state": 1, "paging": 2, "engine": 3, "checkpoint": 4, "optim": 5,
         "integrations": 6, "reference": 6, "cli": 7, "face": 8}
# The modules at the package's top: the native module and its loader below every layer, the
# package face (and `python -m pagedoptim`, and the old names' finder) above them all.
TOP_LEVEL = {"_native": "base", "_validation": "base", "_C": "base", "__init__": "face",
             "__main__": "face", "_moved_modules": "face"}


def _layer_of_module(dotted: str) -> str:
    """The layer of a module named pagedoptim.X[.Y]: X, or the face for `pagedoptim`."""
    parts = dotted.split(".")
    first = "__init__" if len(parts) == 1 else parts[1]
    return TOP_LEVEL.get(first, first)


def _imports_of(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) for every pagedoptim module `path` imports, at any depth of its code."""
    import ast
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("pagedoptim")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "pagedoptim":
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                as_file = PACKAGE.joinpath(*candidate.split(".")[1:])
                is_module = as_file.with_suffix(".py").exists() or as_file.is_dir() \
                    or alias.name == "_C"
                found.append((node.lineno, candidate if is_module else node.module))
    return found


def test_every_module_belongs_to_a_layer():
    for path in PACKAGE.rglob("*.py"):
        first = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        assert TOP_LEVEL.get(first, first) in RANKS, f"{path.relative_to(PACKAGE)} is in no layer"


def test_every_import_points_down_the_layers():
    """What the folder names promise: state/ < paging/ < engine/ < checkpoint/ < optim/ <
    integrations/, reference/ < cli/ < the package face. A module may import its own layer
    and the ones below, never one above, never the face."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE)
        first = where.parts[0].removesuffix(".py")
        layer = TOP_LEVEL.get(first, first)
        for line, module in _imports_of(path):
            target = _layer_of_module(module)
            if target == layer:
                continue
            if RANKS[target] >= RANKS[layer]:
                wrong.append(f"{where}:{line} ({layer}) imports {module} ({target})")
    assert not wrong, "imports that point up or across the layers:\n" + "\n".join(wrong)


def _optimizer_privates() -> set[str]:
    """Every _name an optimizer has: its classes' methods and attributes, and what
    construction and a step put on an instance."""
    names: set[str] = set()
    for cls in (po.PagedOptimizer, po.AdamW, po.SGD, po.Lion, po.SkewAdam):
        names |= {n for n in vars(cls) if n.startswith("_") and not n.startswith("__")}
    p = torch.nn.Parameter(torch.randn(4, 32))
    opt = po.AdamW([p], release_grads=False)
    p.grad = torch.ones_like(p)
    opt.step()
    names |= {n for n in vars(opt) if n.startswith("_") and not n.startswith("__")}
    # torch.optim.Optimizer's own (hooks, the step counter's code) are torch's contract.
    names -= {n for n in vars(torch.optim.Optimizer) if n.startswith("_")}
    return names


def test_only_optim_and_engine_touch_an_optimizer_private():
    """The optimizer's privates are read by its own layer (optim/) and the engine it drives
    (engine/); everything else goes through public names: `optimizer.state_store`,
    `param_groups`, `state`. A subclass of ours calling super() is its own business."""
    import ast
    privates = _optimizer_privates()
    assert {"_store", "_options", "_step_params", "_native_step"} <= privates
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE)
        if where.parts[0] in ("optim", "engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Attribute) and node.attr in privates):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
                continue
            wrong.append(f"{where}:{node.lineno} reads .{node.attr}")
    assert not wrong, "optimizer privates read outside optim/ and engine/:\n" + "\n".join(wrong)


# -- the native module's stub ----------------------------------------------------------------

def _stub_names() -> tuple[set[str], set[str]]:
    """(module-level names, PagedState members) that python/pagedoptim/_C.pyi declares."""
    import ast
    tree = ast.parse((PACKAGE / "_C.pyi").read_text())
    top, members = set(), set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top.add(node.name)
        if isinstance(node, ast.ClassDef) and node.name == "PagedState":
            members = {n.name for n in node.body
                       if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    return top, members


def test_the_native_stub_declares_every_binding():
    """_C.pyi is generated (`pip install pybind11-stubgen; pybind11-stubgen pagedoptim._C -o
    python`); a binding added or removed without regenerating it fails here."""
    from pagedoptim._native import native
    top, members = _stub_names()
    public = {name for name in dir(native) if not name.startswith("_")}
    assert top == public
    assert members == {name for name in dir(native.PagedState) if not name.startswith("_")}
