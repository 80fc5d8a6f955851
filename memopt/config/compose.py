"""Composing a plan config without ``python -m memopt.plan`` (tests, notebooks, the error diagnosis)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memopt.config.store import register
from memopt.resources import configs_dir

__all__ = ["compose_plan_config"]


def compose_plan_config(overrides: list[str] | tuple[str, ...] = (), *, config_name: str = "plan",
                        config_dir: str | Path | None = None, return_hydra_config: bool = False) -> Any:
    """The config ``python -m memopt.plan [--config-dir DIR] [--config-name NAME] OVERRIDES`` would run with.

    ``config_dir`` is an extra folder of primary configs (such as ``recipes/``); the bundled groups
    (``configs/``) are always searched. Raises Hydra's composition errors (see
    :func:`memopt.config.errors.explain_hydra_error`). Clears an initialized ``GlobalHydra``.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    bundled = configs_dir()
    overrides = list(overrides)
    primary = bundled
    if config_dir is not None:
        primary = Path(config_dir).expanduser().resolve()
        if not primary.is_dir():
            raise ValueError(f"config folder {str(config_dir)!r} does not exist (--config-dir)")
        if primary != bundled:
            overrides = [f"hydra.searchpath=[file://{bundled}]", *overrides]
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(primary), version_base=None, job_name="memopt.plan"):
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=return_hydra_config)
