"""The developer docs cite only what exists: every file, module, function and name in backticks in
docs/extending.md is checked against the source (as ``option_docs`` holds the options page's tables), and the
README stays a user's page."""

import ast
import fnmatch
import functools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpo_kernels"
EXTERNAL = ("torch", "triton", "tl", "pytest", "transformers", "trl")  # cited, not ours to check


@functools.cache
def _sources() -> dict:
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    files += [*(ROOT / "tools").glob("*.py")]
    return {path: ast.parse(path.read_text()) for path in files}


@functools.cache
def _definitions(path: pathlib.Path) -> dict:
    """Every name ``path`` defines: functions, classes, assignment targets (attributes too), parameters."""
    names = {}
    for node in ast.walk(_sources()[path]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.setdefault(node.name, node)
            if not isinstance(node, ast.ClassDef):
                for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                    names.setdefault(arg.arg, None)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        names.setdefault(n.id, None)
                    elif isinstance(n, ast.Attribute):
                        names.setdefault(n.attr, None)
    return names


def _class_members(cls: ast.ClassDef) -> set:
    members = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.add(node.target.id)
        elif isinstance(node, ast.Assign):
            members |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return members


def _defines(path: pathlib.Path, name: str) -> bool:
    """``name`` (a glob allowed: ``DIVISOR_*``), or ``Class.member``, is defined in ``path``."""
    first, _, member = name.partition(".")
    defined = _definitions(path)
    if not member:
        return any(fnmatch.fnmatchcase(n, first) for n in defined)
    cls = defined.get(first)
    return isinstance(cls, ast.ClassDef) and member in _class_members(cls)


def _file(relative: str):
    for base in (PACKAGE, ROOT):
        if (base / relative).exists():
            return base / relative
    return None


def citation_error(cited: str):
    """Why ``cited`` names nothing that exists, or None. Forms: a path (``kernels/logits_launch.py``, from the package
    or the repository root), ``path::name`` or ``path::Class.member``, ``module.name`` (``contracts.DIVISOR_*``,
    ``kernels.contracts.TokenInputs``), a dotted attribute chain (``opts.loss.policy_term``) and a bare name."""
    if "::" in cited:
        relative, name = cited.split("::", 1)
        path = _file(relative)
        if path is None:
            return f"no file {relative}"
        return None if _defines(path, name) else f"{relative} defines no {name}"
    if "/" in cited or re.search(r"\.(py|md|json|sh|toml)$", cited):
        return None if _file(cited.rstrip("/")) else f"no file {cited}"
    parts = cited.split(".")
    if parts[0] in EXTERNAL:
        return None
    for k in range(len(parts) - 1, 0, -1):  # the longest prefix that names one of our modules
        modules = [p for p in _sources() if p.as_posix().endswith("/" + "/".join(parts[:k]) + ".py")]
        if modules:
            rest = ".".join(parts[k:])
            return None if any(_defines(p, rest) for p in modules) else f"{'.'.join(parts[:k])} defines no {rest}"
    if len(parts) == 2 and any(_defines(p, cited) for p in _sources()):  # Class.member
        return None
    missing = [part for part in parts if not any(_defines(p, part) for p in _sources())]
    return f"nothing defines {', '.join(missing)}" if missing else None


def citations(markdown: str) -> list:
    """The code names in backticks, outside fenced blocks: ``tokens=TokenInputs(...)`` cites TokenInputs;
    a phrase with spaces (a code snippet) cites nothing; loss-type names and option values are not names."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    cited = []
    for span in re.findall(r"`([^`\n]+)`", text):
        if re.search(r"\s", span):
            continue
        name = span.split("(")[0].split("=")[-1]
        if re.fullmatch(r"[A-Za-z_][\w./*:-]*", name) and not re.fullmatch(r"[a-z0-9_]+", name):
            cited.append(name)
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", name) and "_" in name:  # a bare snake_case name: a function, a field
            cited.append(name)
    return cited


EXTENDING = (ROOT / "docs" / "extending.md").read_text()
# loss-type names, values and keywords written in snake case on the page that are not code names
NOT_NAMES = {"dr_grpo", "ppo_clip", "capped_ratio", "soft_gate", "sequence_weight", "max_completion_length"}


def test_extending_cites_only_what_exists():
    errors = {c: citation_error(c) for c in citations(EXTENDING) if c not in NOT_NAMES}
    errors = {c: e for c, e in errors.items() if e}
    assert errors == {}, "docs/extending.md cites what the code does not have"
    assert len(citations(EXTENDING)) > 80  # the page is read, not skipped


@pytest.mark.parametrize(
    "cited,wrong",
    [
        ("kernels/logits_launch.py::loss_scalar_args", "defines no loss_scalar_args"),
        ("loss_flags", "nothing defines loss_flags"),
        ("contracts.NO_SUCH_*", "defines no NO_SUCH_*"),
        ("kernels/nothing.py", "no file"),
        ("GRPOOptions.no_such_member", "nothing defines no_such_member"),
    ],
)
def test_the_citation_check_finds_what_does_not_exist(cited, wrong):
    assert wrong in (citation_error(cited) or "")


def test_the_citation_check_reads_every_form():
    found = citations(
        "`kernels/token_math.py::token_loss_and_grad` `contracts.DIVISOR_*` `tokens=TokenInputs(...)` "
        "`HAS_IW: tl.constexpr = iw is not None` `grpo` `per_token_terms`\n```\nnot_read\n```"
    )
    assert found == [
        "kernels/token_math.py::token_loss_and_grad",
        "contracts.DIVISOR_*",
        "TokenInputs",
        "per_token_terms",
    ]
    assert all(citation_error(c) is None for c in found)


# ---- The site: its pages' snippets, the landing page, the API reference ------------------------------------------

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "grpo_kernels" / "integration" / "README.md"]
NOT_RUN = re.compile(r"<!-- not run: [^>]+ -->\s*$")


def _python_blocks(path: pathlib.Path) -> list:
    """(line, code, runs) of each ```python block on a page: a block right after `<!-- not run: why -->` is shown,
    not run (it needs a model, a cluster or several processes)."""
    lines, blocks, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = lines.index("```", i + 1)
            runs = not (i > 0 and NOT_RUN.search(lines[i - 1]))
            blocks.append((i + 1, "\n".join(lines[i + 1 : end]), runs))
            i = end
        i += 1
    return blocks


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_snippet_on_every_page_runs(page):
    for line, code, runs in _python_blocks(page):
        if runs:
            exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), {})


def test_the_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < 150, f"README.md has {lines} lines: the rest belongs on the site's pages (docs/)"


def test_every_public_name_has_an_api_entry_with_every_argument_described():
    import inspect

    import grpo_kernels

    api = (ROOT / "docs" / "api.md").read_text()
    for name in grpo_kernels.__all__:
        assert f"::: grpo_kernels.{name}\n" in api, f"docs/api.md has no entry for grpo_kernels.{name}"
        obj = getattr(grpo_kernels, name)
        callables = [obj] if not inspect.isclass(obj) else [obj.__init__, getattr(obj, "forward", None)]
        for fn in callables:
            if fn is None or fn is object.__init__ or not (fn.__doc__ or "").count("Args:"):
                continue
            for parameter in inspect.signature(fn).parameters:
                if parameter not in ("self", "cls"):
                    assert re.search(rf"^\s+\**{parameter}: \S", fn.__doc__, re.M), (name, parameter)
        if inspect.isclass(obj) and "Attributes:" in (obj.__doc__ or ""):
            continue
        assert inspect.isclass(obj) or "Args:" in obj.__doc__, f"grpo_kernels.{name}'s docstring lists no Args"


def test_every_adapter_entry_describes_every_argument():
    """The trainer adapters' functions and classes in the API reference: each argument described (their names
    are the trainers' own)."""
    import importlib
    import inspect

    from grpo_kernels.argument_docs import ADAPTER_ARGUMENTS

    api = (ROOT / "docs" / "api.md").read_text()
    checked = set()
    for module_name in ("trl", "verl", "openrlhf", "megatron"):
        module = importlib.import_module(f"grpo_kernels.integration.{module_name}")
        for name in ADAPTER_ARGUMENTS:
            obj = getattr(module, name, None)
            if obj is None:
                continue
            assert name in api, f"docs/api.md does not list grpo_kernels.integration.{module_name}.{name}"
            methods = (
                [vars(obj)[m] for m in ("__init__", "forward") if m in vars(obj)] if inspect.isclass(obj) else [obj]
            )
            for fn in methods:
                assert "\nArgs:\n" in fn.__doc__, f"{module_name}.{fn.__qualname__}'s docstring lists no Args"
                for parameter in inspect.signature(fn).parameters:
                    if parameter not in ("self", "cls"):
                        assert re.search(rf"^\s+\**{parameter}: \S", fn.__doc__, re.M), (module_name, name, parameter)
            checked.add(name)
    assert checked == set(ADAPTER_ARGUMENTS), set(ADAPTER_ARGUMENTS) - checked
