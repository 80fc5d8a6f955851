"""The package's layers, read from its source: no module imports from a layer above its own, at module level or
inside a function, no module imports another module's private name, and a memopt import inside a function says
why it is not at module level (``# lazy: ...`` or ``# cycle: ...``).

The layers, lowest first, are ARCHITECTURE.md's pipeline: the vocabulary (bytes, strategies, hardware), the models,
the techniques, the training step they make, profile, estimate, the sharded engines' estimates, plan, config, apply,
guard, the integrations; the entry points (``memopt``, ``memopt.wrap``, the ``__main__`` modules) may use any."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("vocabulary", ("memopt.units", "memopt.categories", "memopt.strategy", "memopt.hardware", "memopt.blocks",
                    "memopt.kernel_ops", "memopt.host_speed",
                    "memopt.resources", "memopt._callable_module", "memopt.errors", "memopt.progress")),
    ("models", ("memopt.models",)),
    ("techniques", ("memopt.techniques",)),
    ("step", ("memopt.step",)),
    ("profile", ("memopt.profile",)),
    ("estimate", ("memopt.estimate",)),
    ("distributed", ("memopt.distributed",)),
    ("plan", ("memopt.plan",)),
    ("config", ("memopt.config",)),
    ("apply", ("memopt.apply",)),
    ("guard", ("memopt.guard", "memopt.calibration")),
    ("integrations", ("memopt.integrations", "memopt.report", "memopt.train", "memopt.cli_render")),
    ("entry", ("memopt", "memopt.apply.wrap", "memopt.apply.wrapped", "memopt.plan.__main__",
               "memopt.calibration.__main__", "memopt.report.__main__", "memopt.train.__main__")),
]

def _layer(module: str) -> int:
    best, length = -1, -1
    for index, (_name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = index, len(prefix)
    assert best >= 0, f"{module} is in no layer: add it to LAYERS"
    return best


def _imports() -> list[tuple[str, str, str, bool, list[str]]]:
    """(file, importing module, imported module, at module level?, imported names) for every memopt import."""
    out = []
    for path in sorted((ROOT / "memopt").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "memopt":
                names = [a.name for a in node.names]
                targets = [node.module] if node.module != "memopt" else [f"memopt.{n}" for n in names]
                for target in targets:
                    out.append((rel, module, target, id(node) in top, names))
    return out


def test_no_module_level_import_reaches_a_higher_layer():
    upward = [f"{rel}: {target} ({LAYERS[_layer(target)][0]} above {LAYERS[_layer(mod)][0]})"
              for rel, mod, target, top, _ in _imports() if top and _layer(target) > _layer(mod)]
    assert not upward, "\n".join(upward)


def test_no_function_local_import_reaches_a_higher_layer():
    """A function-local import does not hide a cycle: a lower layer that needs something from above takes it as an
    argument (the traces pass the step their stand-ins, ``memopt.step.prepare.StandIns``)."""
    upward = sorted(f"{rel}: {target}" for rel, mod, target, top, _ in _imports()
                    if not top and _layer(target) > _layer(mod))
    assert not upward, "\n".join(upward)


def test_no_private_name_is_imported_from_another_module():
    private = [f"{rel}: {target}.{name}" for rel, _mod, target, _top, names in _imports() for name in names
               if name.startswith("_") and not name.startswith("__")]
    assert not private, "\n".join(private)


REASONS = ("# lazy:", "# cycle:")


def _unjustified(source: str) -> list[tuple[int, str]]:
    """(line, module) of each memopt import inside a function or class of ``source`` (not at module level, nor
    under a module-level ``if``/``try`` such as ``if TYPE_CHECKING:``) without a ``# lazy: ...`` or ``# cycle: ...``
    comment after it or on the line above."""
    tree = ast.parse(source)
    lines = source.splitlines()
    top = {id(node) for node in tree.body}
    for node in tree.body:
        if isinstance(node, (ast.If, ast.Try)):
            top |= {id(inner) for inner in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if id(node) in top:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "memopt":
            module = node.module
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "memopt" for a in node.names):
            module = next(a.name for a in node.names if a.name.split(".")[0] == "memopt")
        else:
            continue
        own = [line.partition("#")[2] for line in lines[node.lineno - 1:node.end_lineno] if "#" in line]
        above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
        if not any(("#" + c).strip().startswith(REASONS) for c in own) and not above.startswith(REASONS):
            out.append((node.lineno, module))
    return out


def test_function_local_memopt_imports_are_justified():
    """A memopt import inside a function says why it is not at module level: ``# lazy: <what it keeps out of an
    import>`` (an optional or heavy package, or a module ``import memopt`` does not load) or ``# cycle: <a> imports
    <b>`` (the import cycle it breaks). Anything else belongs in the module's import block."""
    found = []
    for path in sorted((ROOT / "memopt").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        found += [f"{rel}:{line}: {module}" for line, module in _unjustified(path.read_text())]
    assert not found, "function-local imports without '# lazy: ...' or '# cycle: ...':\n" + "\n".join(found)


def test_the_justification_check_sees_a_bare_function_local_import():
    source = ("from memopt.units import MiB\n"
              "if TYPE_CHECKING:\n    from memopt.plan.schema import Plan\n"
              "def f():\n    from memopt.units import GiB\n    import memopt.plan\n"
              "    from memopt.units import KiB  # lazy: a reason\n"
              "    # cycle: memopt.a imports memopt.b\n    from memopt.units import TiB\n"
              "    from memopt.units import (  # lazy: a reason\n        PiB,\n    )\n"
              "    from torch import nn\n")
    assert _unjustified(source) == [(5, "memopt.units"), (6, "memopt.plan")]


def test_the_layer_check_sees_an_upward_import():
    assert _layer("memopt.profile.trace") > _layer("memopt.techniques.checkpointing")
    assert _layer("memopt.apply.wrap") == len(LAYERS) - 1 > _layer("memopt.apply.autotune")
