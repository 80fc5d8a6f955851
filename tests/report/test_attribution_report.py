"""After a run: one step recorded by module (memopt.wrap with run_dir, on the CPU over memopt's tracker), the
report beside the prediction, and an injected out-of-memory error's post-mortem naming the module group."""

import json

import pytest
import torch
from rich.console import Console

import memopt
from memopt.cli_render import render_plan
from memopt.guard.faults import FaultInjector
from memopt.models import SampleSpec, build_model, make_batch, with_overrides
from memopt.profile.attribution import group_of
from memopt.profile.tracker import MemoryTracker
from memopt.report.__main__ import main as report_main
from memopt.units import allocator_size as a

SAMPLE = {"batch_size": 4, "seq_len": 64}
SPEC = with_overrides("tiny_llama", {"num_hidden_layers": 5})


def _wrapped(run_dir, spec=SPEC, sample=SAMPLE):
    torch.manual_seed(0)
    model = build_model(spec, device="cpu")
    w = memopt.wrap(model, budget="16GB", sample=sample, hardware="h100_80gb", lr=1e-3, run_dir=run_dir)
    return model, w, make_batch(spec, SampleSpec.parse(sample, spec))


def _group(name: str) -> str:
    return group_of(name.rpartition(".")[0], "forward", ["model.layers"],
                    {"model.embed_tokens": "forward[0]", "model.norm": "fwd:gap.s0", "lm_head": "fwd:gap.s0",
                     "model.rotary_emb": "forward[0]"})


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    model, w, batch = _wrapped(run_dir)
    # an independent count of the same step: every live storage, the model's tensors and the batch tracked first
    probe = MemoryTracker("cpu", record=False)
    with probe:
        for t in [*model.parameters(), *model.buffers(), *batch.values()]:
            probe.track(t)
        probe.reset_peak()
        w.step(batch)
    w.step(batch)
    w.close()
    return model, w, run_dir, probe.peak_bytes


def test_the_recorded_step_is_the_step_as_counted_independently(cpu_run):
    model, _w, run_dir, probe_peak = cpu_run
    measured = json.loads((run_dir / "attribution_measured.json").read_text())
    assert measured["step"] == 0 and measured["device"] == "cpu"
    assert measured["peak_allocated_bytes"] == probe_peak == sum(measured["by_category"].values())
    expected: dict[str, int] = {}
    for name, p in [*model.named_parameters(), *model.named_buffers()]:  # buffers count as parameters
        expected[_group(name)] = expected.get(_group(name), 0) + a(p.numel() * p.element_size())
    assert {g: v.get("parameters", 0) for g, v in measured["by_group"].items() if v.get("parameters")} == expected
    assert sum(v.get("activations", 0) for v in measured["by_group"].values()) > 0
    layers = [t for t in measured["top_tensors"] if t["group"] == "model.layers" and t["category"] == "activations"]
    assert layers and all(t["module"].startswith("model.layers.") and t["op"] for t in layers)


def test_report_puts_the_measured_step_beside_the_prediction(cpu_run, capsys):
    _, w, run_dir, _ = cpu_run
    assert report_main([str(run_dir)]) == 0
    out = run_dir / "report"
    html = (out / "attribution.html").read_text()
    assert "data:image/png;base64," in html and "<table>" in html  # self-contained: the picture is inlined
    assert (out / "attribution_timeline.png").read_bytes()[:4] == b"\x89PNG"
    report = json.loads((out / "attribution.json").read_text())
    predicted = w.plan.prediction["attribution"]["steps"][0]
    assert report["predicted"]["by_group"] == predicted["by_group"]
    for row in report["comparison"]["rows"]:
        assert row["difference_bytes"] == row["measured_bytes"] - row["predicted_bytes"]
        if row["category"] == "parameters":  # the CPU holds exactly the planned weights
            assert row["difference_bytes"] == 0, row
    phases = [p for p, _ in report["measured"]["timeline"]["phases"]]
    assert phases == ["forward", "backward", "optimizer"]
    assert "attribution_html" in capsys.readouterr().out


def test_dry_run_report_has_the_group_table(cpu_run):
    _, w, _, _ = cpu_run
    console = Console(record=True, width=160)
    render_plan(w.plan, console=console)
    text = console.export_text()
    assert "Where the bytes go at the predicted peak" in text and "model.layers" in text
    assert "Largest live tensors at the peak" in text
    attr = w.plan.to_dict()["prediction"]["attribution"]
    assert sum(sum(g.values()) for g in attr["by_group"].values()) == w.plan.total_bytes


@pytest.mark.slow  # ~40 s on 2 cores: two plans (the first and the escalated one)
def test_injected_oom_post_mortem_names_the_module_group(tmp_path):
    # activations large enough against the model states that a smaller plan exists (as tests/apply/test_wrap_guard)
    spec = with_overrides("tiny_llama", {"hidden_size": 256, "intermediate_size": 512, "vocab_size": 4096})
    _, w, batch = _wrapped(tmp_path, spec, {"batch_size": 8, "seq_len": 256})
    before = w.plan.strategy.label()
    injector = FaultInjector(at_attempt=0, phase="backward", after_ops=40)
    w.guard.oom.phase_listeners.append(injector.on_phase)
    with injector:
        w.step(batch)  # the first step: recorded by module, fails in backward, re-planned and retried
    w.close()
    assert injector.fired and w.plan.strategy.label() != before
    [failure] = json.loads((tmp_path / "attribution_oom.json").read_text())
    assert failure["phase"].startswith(("bwd:", "backward")) and failure["op"]
    assert sum(failure["by_category"].values()) == failure["total_bytes"] > 0
    assert report_main([str(tmp_path)]) == 0
    [pm] = json.loads((tmp_path / "report" / "postmortem.json").read_text())
    where = pm["attribution"]
    assert where["failing_module"] == failure["module"] and where["failing_group"] == failure["group"]
    assert "re-planned" in where["action"]
    predicted = json.loads((tmp_path / "plan.json").read_text())["prediction"]["attribution"]["steps"][0]
    if "culprit_group" in where:  # measured minus planned, for the group and category that overran the most
        g, c = where["culprit_group"], where["culprit_category"]
        assert where["over_bytes"] == failure["by_group"][g][c] - predicted["by_group"].get(g, {}).get(c, 0) > 0
    assert where["text"] in pm["module_verdict"] and failure["module"] in pm["module_verdict"]
    md = (tmp_path / "report" / "summary.md").read_text()
    assert "Where:" in md


@pytest.mark.slow  # ~30 s on 2 cores
def test_a_hugging_face_trainer_records_its_first_step(tmp_path):
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = build_model("tiny_llama", device="cpu")
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": (ids := torch.randint(3, 256, (32,), generator=g)), "labels": ids.clone()}
            for _ in range(16)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                             learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
                             logging_strategy="no", disable_tqdm=True)
    trainer = memopt.wrap(Trainer(model=model, args=args, train_dataset=data), budget="4GB", hardware="h200")
    trainer.train()
    run = tmp_path / "memopt"
    measured = json.loads((run / "attribution_measured.json").read_text())
    expected: dict[str, int] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        expected[_group(name)] = expected.get(_group(name), 0) + a(t.numel() * t.element_size())
    assert {g: v["parameters"] for g, v in measured["by_group"].items() if v.get("parameters")} == expected
    assert [p for p, _ in measured["timeline"]["phases"]] == ["forward", "backward", "optimizer"]
    assert report_main([str(run)]) == 0
    assert (run / "report" / "attribution.html").exists()


def test_a_closed_recorded_run_releases_its_model(tmp_path):
    """The recorder's per-storage finalizers outlive the step on every parameter and optimizer state; they must not
    keep the tracker, and through it the model and its states, alive (on a GPU: a whole model's memory held for
    the process's life, counted against the next run's plan)."""
    import gc
    import weakref

    model, w, batch = _wrapped(tmp_path / "run")
    w.attribution_step = 0
    w.step(batch)
    w.close()
    assert (tmp_path / "run" / "attribution_measured.json").exists()
    alive = weakref.ref(model)
    del model, w
    gc.collect()
    assert alive() is None
