"""The dry run's report, rendered with ``rich``: what the plan chose, what each choice saves and costs, the
memory against the budget, the predicted step time, the runners-up and why the rest lost.

Usable without Hydra: ``render_plan(memopt.plan(...), console=Console())``.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from memopt.report.attribution import plan_renderables  # where the bytes go: module group x category
from memopt.techniques.registry import BY_NAME, TECHNIQUES
from memopt.units import format_bytes

__all__ = ["describe_sample", "make_console", "render_errors", "render_plan"]

# each searched technique's name as the dry run's tables show it, for the rejections table
_TITLES = {t.name: t.title for t in TECHNIQUES}
_CATEGORY_ORDER = ("parameters", "gradients", "optimizer_states", "activations", "temporaries", "allocator_overhead",
                   "runtime")


def make_console(*, stderr: bool = False) -> Console:
    """A console that is at least 120 columns wide when the output is not a terminal (pipes, CI logs)."""
    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:
        console = Console(stderr=stderr, highlight=False, width=max(console.width, 120))
    return console


def _count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if abs(seconds) < 10 else f"{seconds:.2f} s"


def describe_sample(sample: dict[str, Any]) -> str:
    """``8 x 1024 tokens`` / ``64 images, 224 px`` / ``8 x 512 -> 128 tokens`` / tensors of a user module."""
    b = sample.get("batch_size")
    if "tensors" in sample:
        parts = [f"{k} {'x'.join(map(str, shape))} {dtype.replace('torch.', '')}"
                 for k, (shape, dtype) in sample["tensors"].items()]
        return f"batch of {b}: " + ", ".join(parts)
    if sample.get("image_size"):
        size = sample["image_size"]
        height, width = size if isinstance(size, (list, tuple)) else (size, size)
        return f"{b} images of {height} x {width} px"
    seq, dec = sample.get("seq_len"), sample.get("decoder_seq_len")
    text = f"{b} x {seq} tokens per step (global batch"
    if dec and dec != seq:
        text = f"{b} x {seq} -> {dec} tokens per step (encoder -> decoder; global batch"
    if sample.get("variable_length"):
        text += "; variable length, planned for the longest"
    return text + ")"


def _saves(entry: dict[str, Any] | None) -> tuple[str, str]:
    if not entry:
        return "—", "—"
    saved, cost = entry.get("saves_bytes", 0), entry.get("costs_s", 0.0)
    saves = format_bytes(saved) if saved >= 0 else f"uses {format_bytes(-saved)} more"
    if abs(cost) < 5e-6:
        costs = "none"
    elif cost > 0:
        costs = f"+{_ms(cost)}"
    else:
        costs = f"{_ms(cost)} (faster)"
    return saves, costs


def _header(plan: Any, hardware: Any, budget_text: Any) -> Panel:
    model = plan.model
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    params = f"{_count(model.get('num_params', 0))} parameters"
    if model.get("num_trainable_params") not in (None, model.get("num_params")):
        params += f", {_count(model['num_trainable_params'])} trainable"
    grid.add_row("model", f"{model.get('name')} ({model.get('class')}, {params})")
    grid.add_row("sample", describe_sample(model.get("sample") or {}))
    hw = plan.hardware
    if hardware is not None:
        hw = f"{hardware.name} ({format_bytes(hardware.memory_bytes)}, sm{hardware.sm})"
    grid.add_row("hardware", hw)
    budget = format_bytes(plan.budget_bytes)
    if budget_text is not None and str(budget_text) != str(plan.budget_bytes):
        budget = f"{budget_text} = {budget}"
    grid.add_row("budget", f"{budget} per GPU")
    policy = plan.policy or {}
    pol = "fidelity " + ", ".join(policy.get("allow", []))
    if policy.get("pins"):
        pol += "; pinned " + ", ".join(f"{k}={v}" for k, v in policy["pins"].items())
    if policy.get("forbid"):
        pol += "; forbidden " + ", ".join(f"{k}={v}" for k, v in policy["forbid"].items())
    grid.add_row("policy", pol)
    return Panel(grid, title="memopt plan", title_align="left", expand=False)


def _verdict(plan: Any) -> Text:
    budget, total, margin = plan.budget_bytes, plan.total_bytes, plan.margin_bytes
    if plan.fits:
        head = Text(" FITS ", style="bold black on green")
        head.append(f"  GPU: {format_bytes(total)} predicted of {format_bytes(budget)} "
                    f"(margin {format_bytes(margin)}, headroom {format_bytes(budget - total - margin)})")
        for tier in tier_lines(plan):
            head.append(f"\n       {tier}")
        return head
    head = Text(" DOES NOT FIT ", style="bold white on red")
    message = (plan.infeasible or {}).get("message", "no strategy fits")
    head.append(f"  {message}")
    return head


def tier_lines(plan: Any) -> list[str]:
    """The host-RAM and NVMe tiers a plan needs, each against what it was checked with (an offload plan's FITS
    covers them too, so the verdict says them beside the GPU's)."""
    pred = plan.prediction or {}
    lines = []
    host = pred.get("host_bytes_per_node")
    if host:
        ram = (plan.search or {}).get("host_memory_bytes_per_node")
        source = (plan.search or {}).get("host_memory_source") or "hardware.host_memory_bytes"
        against = f" of {format_bytes(ram)} ({source})" if ram else ""
        lines.append(f"host RAM: {format_bytes(host)} per node{against}")
    nvme = pred.get("nvme_bytes_per_node")
    if nvme:
        path = dict(plan.strategy.extras).get("sharding")
        path = getattr(path, "nvme_path", None) if path is not None and not isinstance(path, dict) else \
            (path or {}).get("nvme_path")
        lines.append(f"NVMe: {format_bytes(nvme)} per node" + (f" at {path}" if path else ""))
    return lines


def _techniques_table(plan: Any) -> Table:
    table = Table(title="Chosen techniques" if plan.fits else "Smallest footprint found", title_justify="left")
    table.add_column("technique")
    table.add_column("choice", style="bold")
    table.add_column("saves", justify="right")
    table.add_column("costs per step", justify="right")
    techniques = plan.techniques
    for technique in TECHNIQUES:
        saves, costs = _saves(plan.savings.get(technique.name))
        table.add_row(technique.title, technique.render(techniques.get(technique.name), techniques), saves, costs)
    for name, value in (techniques.get("extras") or {}).items():
        extra = BY_NAME.get(name)
        table.add_row(name if extra is None else extra.title,
                      str(value) if extra is None else extra.render(value, techniques), "—", "—")
    return table


def _breakdown_table(plan: Any) -> Table:
    data = plan.to_dict()
    breakdown: dict[str, int] = dict(data.get("breakdown") or {})
    budget = plan.budget_bytes
    table = Table(title="Memory at the peak, per GPU", title_justify="left")
    table.add_column("")
    table.add_column("size", justify="right")
    table.add_column("of budget", justify="right")

    def pct(n: int) -> str:
        return f"{100 * n / budget:.1f}%" if budget else ""

    order = [k for k in _CATEGORY_ORDER if k in breakdown] + sorted(set(breakdown) - set(_CATEGORY_ORDER))
    for key in order:
        table.add_row(key.replace("_", " "), format_bytes(breakdown[key]), pct(breakdown[key]))
    total, margin = plan.total_bytes, plan.margin_bytes
    headroom = budget - total - margin
    table.add_section()
    table.add_row("total predicted", format_bytes(total), pct(total), style="bold")
    table.add_row("safety margin", format_bytes(margin), pct(margin))
    table.add_row("headroom" if headroom >= 0 else "over budget", format_bytes(abs(headroom)), pct(abs(headroom)),
                  style="green" if headroom >= 0 else "red")
    table.add_row("budget", format_bytes(budget), "100.0%")
    return table


def _peak_line(plan: Any) -> Text:
    data = plan.to_dict()
    text = Text(f"peak allocated {format_bytes(plan.peak_allocated_bytes)}, peak reserved "
                f"{format_bytes(plan.peak_reserved_bytes)}, outside the allocator "
                f"{format_bytes(int(data.get('runtime_bytes') or 0))}", style="dim")
    if data.get("peak_at"):
        text.append(f"; the peak is at {data['peak_at']}")
    return text


def _time_line(plan: Any) -> Text:
    pred = plan.prediction
    text = Text("Step time ", style="bold")
    if not plan.fits:  # no strategy was timed as the one to run: the smallest footprint carries no step time
        text.append("— (the plan does not fit the budget)")
        return text
    text.append(_ms(plan.step_time_s))
    parts = [f"{name} {_ms(pred[key])}" for key, name in (("forward_s", "forward"), ("backward_s", "backward"),
                                                           ("optimizer_s", "optimizer")) if key in pred]
    if parts:
        text.append(f" ({', '.join(parts)})")
    for key, value in plan.to_dict().items():
        if key.endswith("_per_s") and value:
            text.append(f"   throughput {value:,.0f} {key[:-6]}/s", style="bold")
    return text


def _runners_up_table(plan: Any) -> Table | None:
    if not plan.runners_up:
        return None
    table = Table(title="Runners-up", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("strategy")
    table.add_column("memory", justify="right")
    table.add_column("step time", justify="right")
    table.add_column("vs chosen", justify="right")
    for i, r in enumerate(plan.runners_up, 1):
        step = r.get("step_time_s")
        ratio = f"{step / plan.step_time_s:.2f}x" if step and plan.step_time_s else "—"
        table.add_row(str(i), r.get("label", ""), format_bytes(r.get("total_bytes", 0)),
                      _ms(step) if step else "—", ratio)
    return table


def _rejected_table(plan: Any) -> Table | None:
    if not plan.rejected:
        return None
    table = Table(title="Why the other choices lost", title_justify="left", show_lines=False)
    table.add_column("technique")
    table.add_column("alternatives")
    for field, reason in plan.rejected.items():
        table.add_row(_TITLES.get(field, field), reason.replace("; ", "\n"))
    return table


def _relaxations_table(plan: Any) -> Table | None:
    relax = (plan.infeasible or {}).get("relaxations") or []
    if not relax:
        return None
    table = Table(title="What allowing more would reach", title_justify="left")
    table.add_column("allow (policy.fidelity)")
    table.add_column("smallest total", justify="right")
    table.add_column("fits", justify="center")
    for r in relax:
        reach = ("at least " if r.get("lower_bound") else "") + format_bytes(r["reaches_bytes"])
        table.add_row(r["allow"], reach, {True: "yes", None: "not estimated"}.get(r.get("fits"), "no"))
    return table


def _search_line(plan: Any) -> Text:
    s = plan.search or {}
    text = Text("Search ", style="bold")
    text.append(f"{s.get('candidates', 0)} candidates, {s.get('evaluated', 0)} evaluated, "
                f"{s.get('pruned_as_slower', 0)} pruned as slower, {s.get('pruned_as_too_big', 0)} pruned as too big")
    if "seconds" in s:
        text.append(f"; {s['seconds']:.1f} s")
        extra = []
        if s.get("search_s") is not None:
            extra.append(f"search {s['search_s']:.1f} s")
        if s.get("profile_trace_s"):
            extra.append(f"profile trace {s['profile_trace_s']:.1f} s, cached for later runs")
        if extra:
            text.append(f" ({'; '.join(extra)})")
    return text


def render_plan(plan: Any, *, hardware: Any = None, budget_text: Any = None, console: Console | None = None) -> None:
    """Print the plan's report. ``hardware`` (a HardwareSpec) and ``budget_text`` (as the user wrote the
    budget) enrich the header."""
    console = console or make_console()
    parts: list[Any] = [_header(plan, hardware, budget_text), _verdict(plan), Text(""), _techniques_table(plan),
                        Text("saves / costs: against the same plan with that technique off (— : that plan was not "
                             "evaluated)", style="dim")]
    relax = _relaxations_table(plan)
    if relax is not None:
        parts += [Text(""), relax]
    parts += [Text(""), _breakdown_table(plan), _peak_line(plan)]
    parts += plan_renderables(plan)
    parts += [Text(""), _time_line(plan)]
    for table in (_runners_up_table(plan), _rejected_table(plan)):
        if table is not None:
            parts += [Text(""), table]
    parts += [Text(""), _search_line(plan)]
    if plan.notes:
        parts.append(Text(""))
        notes = Text("Notes", style="bold")
        for note in plan.notes:
            notes.append(f"\n  • {note}", style="default")
        parts.append(notes)
    console.print(Group(*parts))


def render_errors(problems: list[str], *, console: Console | None = None, title: str = "invalid input") -> None:
    """Print every problem (to stderr by default)."""
    console = console or make_console(stderr=True)
    text = Text(f"memopt.plan: {title}", style="bold red")
    for p in problems:
        text.append(f"\n  - {p}", style="default")
    console.print(text, soft_wrap=True)
