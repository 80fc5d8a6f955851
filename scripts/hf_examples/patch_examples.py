"""Copy transformers' ``examples/pytorch`` scripts into an ignored folder and add memopt to each in one place.

The scripts are Hugging Face's code, not ours: they are read from a transformers git directory (``git show``) or
a source checkout, kept under ``.hf-examples/`` (ignored by git) and never committed. The change to each is the one
a user would make: ``import memopt`` at the top and, right after the statement that builds the Trainer,

    trainer = memopt.wrap(trainer, budget=os.environ["MEMOPT_BUDGET"], ...)

(hardware and pins also from the environment, so that the same patched file serves every run).
"""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EXAMPLES", "Example", "copy_examples", "patch_source"]


@dataclass(frozen=True)
class Example:
    name: str  # our short name
    path: str  # inside the transformers repository


EXAMPLES = {
    "clm": Example("clm", "examples/pytorch/language-modeling/run_clm.py"),
    "translation": Example("translation", "examples/pytorch/translation/run_translation.py"),
    "image": Example("image", "examples/pytorch/image-classification/run_image_classification.py"),
}

IMPORT_LINE = "import json as _memopt_json  # added for memopt\nimport memopt  # added for memopt\n"
WRAP_CALL = ('trainer = memopt.wrap(trainer, budget=os.environ["MEMOPT_BUDGET"], '
             'hardware=os.environ.get("MEMOPT_HARDWARE") or None, '
             'pins=_memopt_json.loads(os.environ.get("MEMOPT_PINS") or "{}"))  # added for memopt')


def _read(example: Example, git_dir: Path | None, ref: str, src: Path | None) -> str:
    if src is not None:
        return (src / example.path).read_text()
    if git_dir is None:
        raise ValueError("name the transformers sources: --transformers-git <git dir> [--ref <rev>] or "
                         "--transformers-src <checkout>")
    out = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{ref}:{example.path}"], capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise ValueError(f"{example.path} is not at {ref} in {git_dir}: {out.stderr.strip()}")
    return out.stdout


def _trainer_statement(tree: ast.Module) -> ast.Assign:
    """The ``trainer = Trainer(...)`` / ``Seq2SeqTrainer(...)`` statement (exactly one in each script)."""
    found = [node for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "trainer" for t in node.targets)
             and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
             and node.value.func.id.endswith("Trainer")]
    if len(found) != 1:
        raise ValueError(f"expected one `trainer = ...Trainer(...)` statement, found {len(found)}")
    return found[0]


def _first_import_line(tree: ast.Module) -> int:
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not (
                isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            return node.lineno
    raise ValueError("the script has no import statement")


def patch_source(source: str) -> str:
    """``source`` with ``import memopt`` before its first import and the wrap right after the Trainer is built."""
    tree = ast.parse(source)
    statement = _trainer_statement(tree)
    lines = source.splitlines(keepends=True)
    indent = lines[statement.lineno - 1][: statement.col_offset]
    end = statement.end_lineno  # 1-based, inclusive
    lines.insert(end, f"{indent}{WRAP_CALL}\n")
    lines.insert(_first_import_line(tree) - 1, IMPORT_LINE)
    patched = "".join(lines)
    ast.parse(patched)
    return patched


def copy_examples(dest: Path, *, git_dir: Path | None = None, ref: str = "HEAD", src: Path | None = None,
                  names: list[str] | None = None) -> dict[str, dict[str, str]]:
    """Originals under ``dest/original``, patched copies under ``dest/patched``; returns, per example, the two
    paths and the original's sha256. With no source named, the copies already in ``dest`` are used."""
    info: dict[str, dict[str, str]] = {}
    origin_file = dest / "origin.json"
    for name in names or list(EXAMPLES):
        example = EXAMPLES[name]
        original = dest / "original" / Path(example.path).name
        patched = dest / "patched" / Path(example.path).name
        if git_dir is not None or src is not None:
            text = _read(example, git_dir, ref, src)
            original.parent.mkdir(parents=True, exist_ok=True)
            original.write_text(text)
        elif not original.exists():
            raise ValueError(f"{original} is missing: name the transformers sources (--transformers-git or "
                             "--transformers-src) once to copy the example scripts")
        text = original.read_text()
        patched.parent.mkdir(parents=True, exist_ok=True)
        patched.write_text(patch_source(text))
        info[name] = {"original": str(original), "patched": str(patched), "upstream_path": example.path,
                      "sha256": hashlib.sha256(text.encode()).hexdigest()}
    if git_dir is not None or src is not None:
        origin = {"git_dir": str(git_dir) if git_dir else None, "src": str(src) if src else None, "ref": ref}
        if git_dir is not None:
            rev = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", ref], capture_output=True, text=True)
            origin["commit"] = rev.stdout.strip()
            version = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{ref}:src/transformers/__init__.py"],
                                     capture_output=True, text=True).stdout
            origin["version"] = next((line.split("=")[1].strip().strip('"') for line in version.splitlines()
                                      if line.startswith("__version__")), None)
        origin_file.write_text(json.dumps(origin, indent=1))
    for name in info:
        info[name]["origin"] = json.loads(origin_file.read_text()) if origin_file.exists() else {}
    return info
