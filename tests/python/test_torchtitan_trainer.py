"""torchtitan's own trainer with megamoe, on the CPU: bench/titan_train.py (the driver scripts/gpu_torchtitan.sh runs
on the GPU) builds torchtitan's Trainer from its config through torchtitan's ConfigManager and runs its train_step
(forward, backward, gradient clipping, AdamW and LR steps) for a few optimizer steps of the Qwen3 MoE debug model (2
layers, one 64-token sequence of bench/titan_data.py's synthetic data), one subprocess per run, for each installed
torchtitan release: 0.3.0 (torchtitan's experts; megamoe switched on by the command line, --override.imports; and by
the converters list of a config-registry function) and 0.2.2 (torchtitan's experts; megamoe by --model.converters).
The runs of a release start from the same weights and data: their losses agree within the experts' bf16 rounding,
and the steps train (the loss moves).

On the CPU the driver points torchtitan's device globals at the CPU and works around its GPU-only pieces (see its
docstring: SDPA attention for 0.3, torchtitan 0.2's per-expert loop for its own experts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework_cases import FRAMEWORKS, load_release

load_release("torchtitan", "torchtitan")  # skips where scripts/install_frameworks.sh has not run
REPO = Path(__file__).resolve().parents[2]
STEPS = 3
RUNS = {  # release: {run: --experts}
    "0.3.0": {"torchtitan": "torchtitan", "megamoe_command_line": "megamoe", "megamoe_converters_list": "megamoe-list"},
    "0.2.2": {"torchtitan": "torchtitan", "megamoe_model_converters": "megamoe"},
}
MEGAMOE_KINDS = {"0.3.0": {"MegamoeRoutedExperts/MegamoeGroupedExperts": 2}, "0.2.2": {"MegamoeMoE/MegamoeGroupedExperts": 2}}
TORCHTITAN_KINDS = {"0.3.0": {"RoutedExperts/GroupedExperts": 2}, "0.2.2": {"MoE/GroupedExperts": 2}}
LOSS_AGREEMENT = 2e-3  # relative: the experts compute in bf16 either way (rounding, not a different model)


def release_environment(version):
    """The subprocesses' environment for this release (its folder and this process's megamoe on PYTHONPATH); skips
    where it is not installed or its trainer does not import with this torch (0.3.0 needs torch >= 2.12)."""
    import megamoe

    folder = FRAMEWORKS / f"torchtitan-{version}"
    if not (folder / ".complete").exists():
        pytest.skip(f"torchtitan {version} is not installed (scripts/install_frameworks.sh)")
    paths = [str(Path(megamoe.__file__).resolve().parents[1]), str(folder), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    probe = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import titan_data; "
                            "titan_data.install_datasets_stand_in(); import torchtitan.train, torchtitan.trainer"
                            if version.startswith("0.3") else "import sys; sys.path.insert(0, sys.argv[1]); "
                            "import titan_data; titan_data.install_datasets_stand_in(); import torchtitan.train",
                            str(REPO / "bench")], env=env, capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"torchtitan {version}'s trainer does not import here: {probe.stderr.strip().splitlines()[-1]}")
    return env


@pytest.fixture(scope="module", params=list(RUNS))
def runs(request, tmp_path_factory):
    version = request.param
    env = release_environment(version)
    folder = tmp_path_factory.mktemp(f"titan-{version}")
    results = {}
    for name, experts in RUNS[version].items():
        out = folder / f"{name}.json"
        command = [sys.executable, str(REPO / "bench" / "titan_train.py"), "--model", "qwen3_moe_debug",
                   "--experts", experts, "--layers", "2", "--steps", str(STEPS), "--device", "cpu", "--json", str(out),
                   "--", "--training.local_batch_size", "1", "--training.seq_len", "64",
                   "--dump_folder" if version == "0.3.0" else "--job.dump_folder", str(folder)]
        run = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, f"torchtitan {version} {name}:\n{run.stdout[-4000:]}\n{run.stderr[-6000:]}"
        results[name] = json.loads(out.read_text())
    return version, results


def test_each_run_has_the_experts_it_asked_for(runs):
    version, results = runs
    for name, result in results.items():
        assert result["torchtitan"] == version, name
        want = TORCHTITAN_KINDS[version] if name == "torchtitan" else MEGAMOE_KINDS[version]
        assert result["experts"] == want, name
        assert result["activation_checkpoint"] == "selective", name  # the debug model's config


def test_trainer_steps_run_and_losses_agree(runs):
    version, results = runs
    reference = results["torchtitan"]["losses"]
    assert len(reference) == STEPS and reference[0] != reference[-1]  # the optimizer steps change the model
    for name, result in results.items():
        assert result["steps_done"] == STEPS, name
        for step, (loss, want) in enumerate(zip(result["losses"], reference), 1):
            assert abs(loss - want) <= LOSS_AGREEMENT * abs(want), f"{name} step {step}: {loss} against {want}"


def test_sdpa_attention_replaces_deepseek_v3_flex_attention_in_the_synthetic_spec_only():
    """bench/titan_train.py --attention sdpa (scripts/gpu_torchtitan.sh's DeepSeek-V3 runs): torchtitan 0.2's
    DeepSeek-V3 16B flavour of the synthetic train spec gets causal SDPA attention (its tokenizer then has no EOS);
    torchtitan's own train spec keeps its flex attention."""
    env = release_environment("0.2.2")
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import titan_legacy as t; "
             "from torchtitan.protocols.train_spec import get_train_spec as g; "
             "t.use_sdpa_attention('deepseek_v3_synthetic', '16B'); "
             "a = g('deepseek_v3_synthetic').model_args['16B']; b = g('deepseek_v3').model_args['16B']; "
             "print(a.attn_type, a.attn_mask_type, b.attn_type, b.attn_mask_type)")
    run = subprocess.run([sys.executable, "-c", probe, str(REPO / "bench")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split() == ["sdpa", "causal", "flex", "block_causal"]
