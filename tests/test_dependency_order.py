"""The documented module dependency order holds: every module of ``src/jpinfer`` belongs to exactly one row
of the table under "## Module dependency order" in docs/architecture.md, and none imports from a higher
row (imports inside functions and under ``TYPE_CHECKING`` count too).

The table's columns are ``| level | modules | import from |``. A name in backticks in the modules column,
outside parentheses (those explain a row), is one module relative to the package: ``errors`` or
``api.py`` a module, ``quant/`` a package with everything under it, ``jpinfer/__init__.py`` the package
root. The "import from" column is prose for the reader; the check is the levels.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "jpinfer"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
HEADING = "## Module dependency order"


def table_levels(markdown: str) -> dict[str, int]:
    """Dotted module name (relative to the package; a package stands for everything under it) -> level."""
    section = markdown.split(HEADING, 1)[1].split("\n## ", 1)[0]
    levels: dict[str, int] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():  # prose, the header and its rule
            continue
        names = re.findall(r"`([^`]+)`", _outside_parentheses(cells[1]))
        if not names:
            raise ValueError(f"level {cells[0]} names no module: {line!r}")
        for name in names:
            module = _module_name(name)
            if module in levels:
                raise ValueError(f"{name!r} is in two rows (levels {levels[module]} and {cells[0]})")
            levels[module] = int(cells[0])
    if not levels:
        raise ValueError(f"no table under {HEADING!r}")
    return levels


def _outside_parentheses(text: str) -> str:
    kept, depth = [], 0
    for char in text:
        depth += char == "("
        if depth == 0:
            kept.append(char)
        depth -= char == ")" and depth > 0
    return "".join(kept)


def _module_name(name: str) -> str:
    name = name.removeprefix("jpinfer/").removeprefix("jpinfer.").rstrip("/").removesuffix(".py")
    return name.replace("/", ".")


def package_modules(package: pathlib.Path = PACKAGE) -> list[str]:
    """Every module of the package, dotted and relative to it (``__init__`` is the package root;
    a sub-package's ``__init__.py`` is the sub-package)."""
    modules = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        modules.append(".".join(parts))
    return modules


def package_imports(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (dotted, relative; ``__init__`` for the root's names)."""
    modules = set(package_modules(package))
    imports: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)
        here = parts[:-1]  # the package a relative import starts from
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(_target(alias.name.split(".")[1:], modules)
                             for alias in node.names if alias.name.split(".")[0] == "jpinfer")
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = list(here[:len(here) - node.level + 1]) + (node.module.split(".") if node.module else [])
                elif node.module and node.module.split(".")[0] == "jpinfer":
                    base = node.module.split(".")[1:]
                else:
                    continue
                found.update(_target([*base, alias.name], modules) for alias in node.names)
        imports[module] = found - {module}
    return imports


def _target(parts: list[str], modules: set[str]) -> str:
    """The deepest module of the package that ``parts`` (a dotted path, perhaps ending in a name) names."""
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return "__init__"


def owner(module: str, levels: dict[str, int]) -> str | None:
    """The table's entry ``module`` belongs to: itself, or the nearest package above it that is listed."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in levels:
            return ".".join(parts[:end])
    return None


def order_problems(levels: dict[str, int], imports: dict[str, set[str]]) -> list[str]:
    """What breaks the order: modules of no row, and each import of a module from a higher level."""
    problems = [f"{module} is in no row of the table" for module in imports if owner(module, levels) is None]
    for module, targets in sorted(imports.items()):
        mine = owner(module, levels)
        for target in sorted(targets):
            theirs = owner(target, levels)
            if mine is not None and theirs is not None and levels[theirs] > levels[mine]:
                problems.append(f"{module} (level {levels[mine]}) imports {target} (level {levels[theirs]})")
    return problems


def test_every_module_in_one_row_and_no_import_goes_up():
    levels = table_levels(ARCHITECTURE.read_text())
    assert order_problems(levels, package_imports()) == []


def test_every_row_names_a_module_that_exists():
    modules = package_modules()
    stale = [name for name in table_levels(ARCHITECTURE.read_text())
             if not any(m == name or m.startswith(name + ".") for m in modules)]
    assert stale == []


def test_the_check_finds_an_upward_import_and_a_module_of_no_row():
    levels = table_levels(
        "## Module dependency order\n\n| level | modules | import from |\n|---|---|---|\n"
        "| 0 | `errors`, `quant/` (the formats, not `api`) | nothing |\n| 1 | `api.py` | level 0 |\n\n## Next\n")
    assert levels == {"errors": 0, "quant": 0, "api": 1}
    imports = {"errors": set(), "quant.int8": {"errors", "api"}, "api": {"quant.int8"}, "stray": {"errors"}}
    assert order_problems(levels, imports) == [
        "stray is in no row of the table", "quant.int8 (level 0) imports api (level 1)"]


def test_the_table_reader_refuses_a_module_in_two_rows():
    with pytest.raises(ValueError, match="two rows"):
        table_levels("## Module dependency order\n| 0 | `errors` | - |\n| 1 | `errors`, `api` | - |\n")


def test_imports_are_read_inside_functions_and_relative(tmp_path):
    package = tmp_path / "jpinfer"
    (package / "stage").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "api.py").write_text("")
    (package / "stage" / "__init__.py").write_text("from .work import run\n")
    (package / "stage" / "work.py").write_text("def run():\n    from jpinfer import api\n    import jpinfer.stage\n")
    assert package_imports(package) == {"__init__": set(), "api": set(), "stage": {"stage.work"},
                                        "stage.work": {"api", "stage"}}
