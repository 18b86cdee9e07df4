"""The torchtitan benchmark's own parts (CPU, no torchtitan import): bench/titan_data.py's synthetic documents and
bench/titan_report.py's table rows, bench/titan_train.py's peak before the optimizer step."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import titan_data  # noqa: E402
import titan_report  # noqa: E402
import titan_train  # noqa: E402


def first_batch(eos_id=None, vocab=100, seq_len=700, batch=3):
    inputs, labels = next(iter(titan_data.SyntheticBatches(vocab, 0, 0, seq_len, batch, eos_id=eos_id)))
    return inputs["input"], inputs["positions"], labels


def test_documents_without_eos_are_marked_by_positions_only():
    tokens, positions, labels = first_batch()
    assert tokens.shape == positions.shape == labels.shape == (3, 700)
    assert (labels >= 0).all()
    inner = positions[:, 1:] != 0  # a label is the next input within its document
    assert torch.equal(labels[:, :-1][inner], tokens[:, 1:][inner])


def test_each_document_ends_in_eos_with_its_label_ignored():
    eos = 99
    tokens, positions, labels = first_batch(eos)
    ends = torch.ones_like(positions, dtype=torch.bool)
    ends[:, :-1] = positions[:, 1:] == 0  # the last token of each document (the row's last one included)
    assert torch.equal(tokens == eos, ends), "EOS exactly at each document's end, nowhere else"
    assert torch.equal(labels == titan_data.IGNORE_INDEX, ends)
    assert ((labels[~ends] >= 0) & (labels[~ends] < eos)).all()
    inner = ~ends[:, :-1] & (tokens[:, 1:] != eos)  # the next input is this one's label, but where that is the EOS
    assert torch.equal(labels[:, :-1][inner], tokens[:, 1:][inner])


def test_eos_must_be_the_last_id():
    with pytest.raises(ValueError, match="eos_id must be the vocabulary's last id"):
        titan_data.SyntheticBatches(100, 0, 0, 64, 1, eos_id=5)


def run(experts, losses, tokens_per_s, compile_=False, ac="full"):
    return {"model": "m", "experts_asked": experts, "compile": compile_, "losses": losses, "steps_done": len(losses),
            "tokens_per_s": tokens_per_s, "peak_active_gib": 10.0, "activation_checkpoint": ac}


def test_rows_compare_with_the_baseline_and_a_repeat_with_it_too():
    runs = {"m-torchtitan-repeat": run("torchtitan", [4.0, 2.2], 100.0),
            "m-torchtitan": run("torchtitan", [4.0, 2.0], 100.0),
            "m-megamoe": run("megamoe", [4.0, 2.1, 1.0], 150.0),
            "m-torchtitan-compile": run("torchtitan", [4.0], 120.0, compile_=True)}
    rows = {row["run"]: row for row in titan_report.rows(runs)}
    assert rows["m-megamoe"]["baseline"] == "m-torchtitan"
    assert rows["m-megamoe"]["speedup"] == pytest.approx(1.5)
    assert rows["m-megamoe"]["agreement"]["steps"] == 2
    assert rows["m-megamoe"]["agreement"]["max_rel_diff"] == pytest.approx(0.05)
    assert rows["m-torchtitan-repeat"]["baseline"] == "m-torchtitan"
    assert rows["m-torchtitan-repeat"]["agreement"]["max_rel_diff"] == pytest.approx(0.1)
    assert "baseline" not in rows["m-torchtitan"] and "baseline" not in rows["m-torchtitan-compile"]


def test_rows_compare_with_the_baseline_of_the_same_activation_checkpointing():
    runs = {"m-torchtitan": run("torchtitan", [4.0, 2.0], 100.0),
            "m-torchtitan-noac": run("torchtitan", [4.0, 2.0], 120.0, ac="none"),
            "m-megamoe-noac": run("megamoe", [4.0, 2.0], 180.0, ac="none"),
            "m-megamoe": run("megamoe", [4.0, 2.0], 150.0)}
    rows = {row["run"]: row for row in titan_report.rows(runs)}
    assert rows["m-megamoe-noac"]["baseline"] == "m-torchtitan-noac"
    assert rows["m-megamoe-noac"]["speedup"] == pytest.approx(1.5)
    assert rows["m-megamoe"]["baseline"] == "m-torchtitan"


def test_peak_before_optimizer_reads_once_per_step_before_the_first_optimizer_step(monkeypatch):
    allocated = iter([100, 200, 300, 400])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: next(allocated))
    peak = titan_train.PeakBeforeOptimizer()
    try:
        weight = torch.nn.Parameter(torch.ones(3))
        optimizers = [torch.optim.AdamW([weight]), torch.optim.SGD([weight], lr=0.1)]
        for _ in range(2):
            peak.start()
            weight.grad = torch.ones(3)
            for optimizer in optimizers:  # as torchtitan's container steps each of its optimizers
                optimizer.step()
        optimizers[0].step()  # outside a step: not read
    finally:
        peak.handle.remove()
    assert peak.peaks == [100, 200]


def test_activation_checkpointing_of_a_run_that_did_not_record_it_comes_from_its_command_line():
    recorded = {"activation_checkpoint": "none", "titan_command_line": ["--activation_checkpoint.mode", "full"]}
    older = {"titan_command_line": ["--activation_checkpoint.mode", "full", "--activation_checkpoint.mode", "none"]}
    assert titan_report.activation_checkpoint_of(recorded) == "none"
    assert titan_report.activation_checkpoint_of(older) == "none"
    assert titan_report.activation_checkpoint_of({"titan_command_line": ["--compile.enable"]}) is None
