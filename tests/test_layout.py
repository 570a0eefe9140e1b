"""The package's layout holds what docs/architecture.md and docs/extending.md say of it: the kernel tier imports
nothing of the front end, and no module outside the registry (``options.py``) and the specification
(``reference.py``) branches on a loss type's name."""

import ast
import os
import pathlib
import re

import pytest

from grpo_kernels.options import LOSS_TYPES

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpo_kernels"
KERNEL_TIER = sorted((PACKAGE / "kernels").glob("*.py"))
# The registry, and the specification, which is written independently of it (by name, on purpose).
NAMES_LOSS_TYPES = {PACKAGE / "options.py", PACKAGE / "reference.py"}


def _imports(tree: ast.AST):
    for node in ast.walk(tree):  # nested imports too (a launcher's lazy import)
        if isinstance(node, ast.ImportFrom):
            yield node.level, node.module or "", node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield 0, alias.name, node.lineno


def front_end_imports(path: pathlib.Path) -> list:
    """The imports of ``path`` (a module under kernels/) that reach outside kernels/ into the package."""
    found = []
    for level, module, line in _imports(ast.parse(path.read_text())):
        outside = level >= 2 or (
            level == 0 and module.startswith("grpo_kernels") and not module.startswith("grpo_kernels.kernels")
        )
        if outside:
            found.append(f"{path.name}:{line}: {'.' * level}{module}")
    return found


def loss_type_name_branches(source: str, name: str = "<source>") -> list:
    """Comparisons with a loss type's name as a string literal (``x == "cispo"``, ``x in ("grpo", "bnpo")``)."""

    def names_a_loss_type(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in LOSS_TYPES
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_a_loss_type(e) for e in node.elts)
        return False

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(names_a_loss_type(n) for n in [node.left, *node.comparators]):
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", KERNEL_TIER, ids=lambda p: p.name)
def test_the_kernel_tier_imports_nothing_of_the_front_end(path):
    assert front_end_imports(path) == [], "the launchers take plain tensors and contracts.KernelLoss, not options"


def test_the_import_check_finds_a_front_end_import(tmp_path):
    module = tmp_path / "launch.py"
    module.write_text(
        "from ..options import GRPOOptions\nimport grpo_kernels.objective\nfrom . import grpo\n"
        "def f():\n    from ..torch_path import fp32_products\n"
    )
    assert [f.split(": ")[1] for f in front_end_imports(module)] == [
        "..options",
        "grpo_kernels.objective",
        "..torch_path",
    ]


def test_no_module_outside_the_registry_and_the_specification_branches_on_a_loss_types_name():
    found = [
        branch
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in NAMES_LOSS_TYPES
        for branch in loss_type_name_branches(path.read_text(), str(path.relative_to(PACKAGE)))
    ]
    assert found == [], "ask the loss type's registry entry (options.LossType) instead of its name"


def test_the_branch_check_finds_a_name_branch():
    source = (
        'if opts.loss_type == "vespo":\n    pass\nscale = 2 if loss_type in ("bnpo", "grpo") else 1\n'
        'ok = opts.loss.policy_term == "ppo_clip"\n'
    )
    assert len(loss_type_name_branches(source)) == 2


def _call_path(run) -> tuple:
    """(the package's files a call enters as Python, the most package frames on the stack above a kernel
    launch) of ``run()``, by a profiler hook. The kernels' own code, which Triton's CPU interpreter runs as
    Python, is not counted (on a GPU it never runs on the host): nothing is counted below an interpreted launch."""
    import sys

    triton_runtime = os.sep + os.path.join("triton", "runtime") + os.sep
    files, depths = set(), [0]

    def below_a_launch(frame) -> bool:
        while frame is not None:
            if triton_runtime in frame.f_code.co_filename:
                return True
            frame = frame.f_back
        return False

    def hook(frame, event, arg):
        if event != "call":
            return
        name = frame.f_code.co_filename
        if triton_runtime in name and not below_a_launch(frame.f_back):  # a launch: count the frames above it
            depth, caller = 0, frame.f_back
            while caller is not None:
                depth += caller.f_code.co_filename.startswith(str(PACKAGE))
                caller = caller.f_back
            depths.append(depth)
        elif name.startswith(str(PACKAGE)) and not below_a_launch(frame.f_back):
            files.add(os.path.relpath(name, PACKAGE))

    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return sorted(files), max(depths)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_a_loss_call_runs_in_a_straight_line(beta, device):
    """One ``grpo_loss`` (or ``GRPOLoss``) forward + backward on the Triton path enters at most 8 of the package's
    files, with at most 7 package frames above a kernel launch (the public function or the Module's forward, the
    pipeline, the input form's schedule, its Function and host function, the launchers)."""
    import torch

    from grpo_kernels import GRPOLoss, grpo_loss

    pytest.importorskip(
        "triton",
        reason="the Triton path's call; triton is a dependency, absent only where "
        "tests/test_without_triton.py checks the CPU path without it",
    )
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 40, generator=g).to(device).requires_grad_()
    ids, mask, adv = (
        t.to(device) for t in (torch.randint(0, 40, (2, 4), generator=g), torch.ones(2, 4), torch.randn(2, generator=g))
    )
    ref = (torch.randn(2, 4, generator=g) - 3.0).to(device)

    def call():
        grpo_loss(
            logits, ids, mask, adv, ref_logps=ref, beta=beta, backend="triton", drop_last_position=True
        ).loss.backward()

    module = GRPOLoss(beta=beta, backend="triton", drop_last_position=True)

    def module_call():
        module(logits, ids, mask, adv, ref_logps=ref).loss.backward()

    for run in (call, module_call):
        run()  # first calls import and compile
        files, frames = _call_path(run)
        assert len(files) <= 8, f"a call enters {len(files)} files: {files}"
        assert frames <= 7, f"{frames} package frames above a launch"


def module_imports(package: pathlib.Path = PACKAGE) -> dict:
    """Each module of the package (dotted, relative to it) -> the package's modules it imports, lazy imports
    included (an import inside a function is an arrow too)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = here[: len(here) - node.level + 1] if node.level > 1 else here
                target = ".".join([p for p in base if p] + ([node.module] if node.module else []))
                submodules = {f"{target}.{a.name}".lstrip(".") for a in node.names} & modules.keys()
                # "from . import ops" imports the submodule ops, not the package
                found |= submodules if len(submodules) == len(node.names) else {target} | submodules
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def import_cycles(graph: dict) -> list:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_the_package_imports_run_one_way():
    graph = module_imports()
    assert {"from_logits", "from_hidden_states", "vocab_parallel", "inputs"} <= graph.keys()
    assert import_cycles(graph) == [], "modules that import each other (lazily too): make the arrows run one way"


def test_the_cycle_check_finds_a_lazy_circle(tmp_path):
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import g\n")
    (tmp_path / "c.py").write_text("from .a import b\n")
    graph = module_imports(tmp_path)
    assert graph["c"] == {"a"} and import_cycles(graph) == [["a", "b"]]


def test_the_front_end_reaches_the_launchers_by_plain_imports():
    """The front end's edge to the kernel tier is an import a reader (and go-to-definition) can follow: the
    launcher modules themselves, not a name resolved at run time; where triton is absent they are stand-ins
    (tests/test_without_triton.py)."""
    from grpo_kernels import from_hidden_states, from_logits, ops
    from grpo_kernels.kernels import fused_linear_launch, logits_launch, reduce_launch

    pytest.importorskip("triton")
    assert from_logits.logits_launch is logits_launch and ops.logits_launch is logits_launch
    assert from_hidden_states.fused_linear_launch is fused_linear_launch
    assert from_hidden_states.reduce_launch is reduce_launch
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name != "training":  # (the trainer loads a user's reward function by its dotted name)
            assert "import_module" not in path.read_text(), f"{path.name} imports a module by a name made at run time"


def _a_letter_apart(a: str, b: str) -> bool:
    """Names a reader confuses: one edit apart (``loss`` / ``less``), or one a plural of the other (``family`` /
    ``families``, ``loss`` / ``losses``)."""

    def stems(name: str) -> set:
        found = {name}
        if name.endswith("ies"):
            found.add(name[:-3] + "y")
        if name.endswith("es"):
            found.add(name[:-2])
        if name.endswith("s"):
            found.add(name[:-1])
        return found

    if a == b:
        return False
    if stems(a) & stems(b):
        return True
    if abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) == 1
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def test_no_two_modules_names_differ_by_a_letter():
    """Rooms are named for what they hold (``methods`` and ``policy_terms``, once ``family`` and ``families``)."""
    names = sorted({p.stem for p in PACKAGE.rglob("*.py") if p.stem != "__init__"})
    close = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :] if _a_letter_apart(a, b)]
    assert close == [], "modules a letter apart"
    assert _a_letter_apart("family", "families") and _a_letter_apart("loss", "losses")
    assert _a_letter_apart("launch", "lunch") and not _a_letter_apart("inputs", "ops")


def test_no_adapter_imports_another_and_each_imports_only_the_core():
    """Each trainer's adapter depends on the core, never on another trainer's (the conventions they share live in
    ``conventions.py``); a trainer's modules (``openrlhf`` and its launcher ``openrlhf_train``) may import each
    other, and ``enable`` (verl's ``external_lib`` entry) imports verl's."""
    graph = module_imports()
    trainer = lambda module: module.split(".")[1].split("_")[0]  # noqa: E731
    adapters = {m for m in graph if m.startswith("integration.") and m != "integration.enable"}
    assert {trainer(m) for m in adapters} == {"trl", "verl", "openrlhf", "megatron"}
    for adapter in adapters | {"integration.enable"}:
        other = {m for m in graph[adapter] & adapters if trainer(m) != trainer(adapter)}
        if adapter == "integration.enable":
            other -= {"integration.verl"}
        assert not other, f"{adapter} imports another trainer's adapter: {sorted(other)}"


def _package_functions() -> list:
    """(module path, name) of every module-level function and class of the package, and of every method that is
    not a dunder or an override of a torch hook (``forward``, ``backward``, ``extra_repr``, ...)."""
    hooks = {"forward", "backward", "setup_context", "extra_repr", "find_spec", "create_module", "exec_module"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.decorator_list:
                found.append((path, node.name))
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef) and not sub.decorator_list and not sub.name.startswith("__"):
                        if sub.name not in hooks:
                            found.append((path, sub.name))
    return found


def test_the_autograd_functions_are_the_ones_docs_extending_counts():
    """One log-prob Function per input form, every sparse feature and sharding a value it takes: the package's
    autograd Functions are as many as docs/extending.md says (a new feature that adds one fails here), and each
    form's log-prob Function takes the entries and the shard."""
    import inspect

    import torch

    from grpo_kernels.from_hidden_states import HiddenStatesLogprobs
    from grpo_kernels.from_logits import LogitsLogprobs

    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("autograd.Function") for b in node.bases):
                found.add(f"{path.relative_to(PACKAGE).with_suffix('')}.{node.name}")
    counted = re.search(r"The package has (\d+) autograd Functions", (ROOT / "docs" / "extending.md").read_text())
    assert counted and len(found) == int(counted.group(1)), sorted(found)
    assert issubclass(LogitsLogprobs, torch.autograd.Function) and issubclass(
        HiddenStatesLogprobs, torch.autograd.Function
    )
    for function in (LogitsLogprobs, HiddenStatesLogprobs):
        assert {"entries", "shard"} <= set(inspect.signature(function.forward).parameters), function


def test_no_function_in_the_package_is_used_only_by_tests():
    """Every function, class and method of the package is used by the package itself, or is documented for users
    (README, docs/, the integration guide, the examples) or run by the benchmarks and tools: none lives here for the
    tests alone (a test's helper lives in the tests)."""
    root = PACKAGE.parent
    users = [root / "README.md", *(root / "docs").glob("*.md"), PACKAGE / "integration" / "README.md"]
    users += [*(root / "examples").glob("*.py"), *(root / "integration").glob("*.py")]
    users += [*(root / "benchmarks").glob("*.py"), *(root / "tools").glob("*.py")]
    outside = "\n".join(p.read_text() for p in users)
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
    import re

    unused = [
        f"{path.relative_to(PACKAGE)}::{name}"
        for path, name in _package_functions()
        if name not in names and not re.search(rf"\b{re.escape(name)}\b", outside)
    ]
    assert unused == [], "used by no code but the tests: move it into the tests, or document it for users"
