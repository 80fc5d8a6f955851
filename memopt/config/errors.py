"""Hydra's and OmegaConf's composition errors, rephrased: what was wrong and what would be valid.

Hydra stops at the first bad override; :func:`diagnose` finds all of them (each override is tried on its
own, in order, on top of the good ones) and then validates what remains, so one run reports everything.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from memopt.config.compose import compose_plan_config
from memopt.config.omegaconf_errors import explain_omegaconf_error, first_line, one_line, root_cause
from memopt.config.validate import validate
from memopt.plan.checks import closest
from memopt.resources import configs_dir

__all__ = ["diagnose", "explain_hydra_error", "explain_omegaconf_error"]

_GROUP_WORDS = {"model": "model", "hardware": "hardware spec", "policy": "policy", "training": "training preset"}


def explain_hydra_error(exc: BaseException, *, primary_dirs: list[Path] | None = None) -> list[str]:
    """A Hydra composition error as messages that name the valid choices."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(exc, MissingConfigException):
        text = str(exc)
        found = re.search(r"Could not find '([^']*)'", text)
        if found and "/" in found.group(1):
            group, _, name = found.group(1).rpartition("/")
            options = sorted(exc.options or [])
            what = _GROUP_WORDS.get(group, f"{group} config")
            if not name:
                return [f"{group}= needs a name: one of {', '.join(options)}"]
            extra = (f"; or put your own {name}.yaml under <dir>/{group}/ and pass --config-dir <dir>"
                     if group in _GROUP_WORDS else "")
            return [f"unknown {what} {name!r}{closest(name, options)}; shipped: {', '.join(options)}{extra}"]
        primary = re.search(r"Cannot find primary config '([^']*)'", text)
        if primary:
            names = sorted({p.stem for d in (primary_dirs or []) for p in Path(d).glob("*.yaml")} - {"base"})
            return [f"no config named {primary.group(1)!r}{closest(primary.group(1), names)}"
                    + (f"; available: {', '.join(names)}" if names else "")
                    + " (--config-name picks one; --config-dir adds a folder such as recipes/)"]
        return [first_line(exc)]
    if isinstance(exc, OverrideParseException):
        return [f"cannot read the override: {first_line(exc)} (grammar: "
                "https://hydra.cc/docs/advanced/override_grammar/basic/)"]
    cause = exc.__cause__
    if isinstance(exc, ConfigCompositionException) and isinstance(cause, OmegaConfBaseException):
        return explain_omegaconf_error(cause)
    if isinstance(exc, OmegaConfBaseException):
        return explain_omegaconf_error(exc)
    taken = re.search(r"An item is already at '([^']*)'", str(exc))
    if taken:  # '+key=value' on a key that has a value: Hydra says so over three lines
        plain = re.search(r"remove \+ prefix: '([^']*)'", str(exc))
        fix = plain.group(1) if plain else f"{taken.group(1)}=<value>"
        return [f"{taken.group(1)} already has a value and '+' only adds keys: write {fix} to change it"]
    root = root_cause(exc)
    if root is not exc:  # Hydra's wrappers end where the reason would start
        return [f"{first_line(exc).rstrip(':').rstrip()}: {type(root).__name__}: {one_line(root)}"]
    return [" ".join(str(exc).split()) or type(exc).__name__]


def diagnose(overrides: list[str], *, config_name: str = "plan", config_dir: str | Path | None = None) -> list[str]:
    """Every problem with ``config_name`` and ``overrides``: composition errors of each override (tried in
    order on top of the good ones) and then :func:`~memopt.config.validate.validate` of what composes."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    dirs = [Path(config_dir)] if config_dir is not None else [configs_dir()]
    problems: list[str] = []

    def attempt(ovs: list[str], *, hydra: bool = False) -> tuple[Any, BaseException | None]:
        try:
            return compose_plan_config(ovs, config_name=config_name, config_dir=config_dir,
                                       return_hydra_config=hydra), None
        except (HydraException, OmegaConfBaseException, ValueError) as exc:
            return None, exc

    def add(items: list[str]) -> None:
        problems.extend(p for p in items if p not in problems)

    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed.append((text, parser.parse_override(text)))
        except HydraException as exc:  # the grammar raises OverrideParseException or a bare HydraException
            add([f"cannot read the override {text!r}: {first_line(exc)} (quote values with spaces or brackets: "
                 "'budget=\"40 GB\"'; grammar: https://hydra.cc/docs/advanced/override_grammar/basic/)"])
    hydra_ovs = [t for t, o in parsed if o.is_hydra_override()]
    base, exc = attempt(hydra_ovs, hydra=True)
    if exc is not None:
        add(explain_hydra_error(exc, primary_dirs=dirs))
        return problems
    groups = set(base.hydra.runtime.choices.keys())

    def variants(text: str, override: Any) -> list[str]:
        if not override.is_sweep_override():
            return [text]
        try:
            return [f"{override.get_key_element()}={v}" for v in override.sweep_string_iterator()]
        except Exception:  # a sweep that needs the config to expand (glob): check the composed result only
            return []

    good: list[str] = []
    ordered = [p for p in parsed if not p[1].is_hydra_override() and p[1].key_or_group in groups] + \
              [p for p in parsed if not p[1].is_hydra_override() and p[1].key_or_group not in groups]
    for text, override in ordered:
        kept = False
        for variant in variants(text, override):
            cfg, exc = attempt([*hydra_ovs, *good, variant])
            if exc is not None:
                add(explain_hydra_error(exc, primary_dirs=dirs))
                continue
            if override.is_sweep_override():  # each job of a sweep must be valid on its own
                add([f"{variant.replace(chr(92) + ' ', ' ')}: {p}" for p in validate(cfg)])
            if not kept:
                good.append(variant)
                kept = True
    cfg, exc = attempt([*hydra_ovs, *good])
    if exc is not None:
        add(explain_hydra_error(exc, primary_dirs=dirs))
    else:
        add(validate(cfg))
    return problems
