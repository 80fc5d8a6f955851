"""Finding the shipped YAML configs (``configs/``) in a source checkout or an installed wheel."""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["config_names", "configs_dir"]


@functools.cache
def configs_dir() -> Path:
    """The directory that holds ``model/``, ``hardware/``, ``policy/`` ... YAML groups."""
    source_tree = Path(__file__).resolve().parent.parent / "configs"
    if (source_tree / "model").is_dir():
        return source_tree
    from importlib import resources

    installed = Path(str(resources.files("memopt._configs")))
    if (installed / "model").is_dir():
        return installed
    raise FileNotFoundError(
        "memopt's bundled configs were not found next to the package nor as memopt._configs; "
        "reinstall memopt (pip install -e .) from its source checkout"
    )


def config_names(group: str) -> list[str]:
    """Names (file stems) of the YAML configs in one group, e.g. config_names('model')."""
    folder = configs_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml"))
