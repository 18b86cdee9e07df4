"""torchtitan 0.3.0's own trainer with megamoe, on the CPU: bench/titan_train.py (the driver the GPU run uses) builds
torchtitan's Trainer from its config through torchtitan's ConfigManager and runs its train_step (forward, backward,
gradient clipping, AdamW and LR steps) for a few optimizer steps of the Qwen3 MoE debug model (2 layers, one
64-token sequence: bench/titan_data.py's synthetic data), in a subprocess per run: torchtitan's experts, megamoe
switched on by the command line (--override.imports), and by the converters list of a config-registry function. The
runs start from the same weights and data; their losses agree within the experts' bf16 rounding, and they train.

On the CPU the driver points torchtitan's device globals at the CPU and uses torchtitan's SDPA attention (flex
attention has no CPU backward); see its docstring."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework_cases import FRAMEWORKS, load_release

VERSION = load_release("torchtitan", "torchtitan")
REPO = Path(__file__).resolve().parents[2]
try:
    import torchdata  # noqa: F401  (torchtitan's trainer module imports it, and torch.utils.tensorboard)
    import torch.utils.tensorboard  # noqa: F401
    from torchtitan.protocols.model import ModelConfigConverter  # noqa: F401
except ImportError as missing:
    pytest.skip(f"torchtitan {VERSION}'s trainer cannot be imported here ({missing}); scripts/install_frameworks.sh "
                "installs its dependencies with torchtitan 0.3.0", allow_module_level=True)

STEPS = 3
RUNS = {  # name: (config function of bench/titan_configs.py, torchtitan command-line arguments)
    "torchtitan": ("qwen3_moe_debug", []),
    "megamoe_command_line": ("qwen3_moe_debug", ["--override.imports",
                                                 "megamoe.adapters.torchtitan_converter.megamoe_experts"]),
    "megamoe_converters_list": ("qwen3_moe_debug_megamoe", []),
}
LOSS_AGREEMENT = 2e-3  # relative: the experts compute in bf16 either way (rounding, not a different model)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("titan")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), str(FRAMEWORKS / f"torchtitan-{VERSION}"),
                                                        os.environ.get("PYTHONPATH", "")])}
    results = {}
    for name, (config, titan_args) in RUNS.items():
        out = folder / f"{name}.json"
        command = [sys.executable, str(REPO / "bench" / "titan_train.py"), "--config", config, "--layers", "2",
                   "--steps", str(STEPS), "--device", "cpu", "--json", str(out), "--",
                   "--training.local_batch_size", "1", "--training.seq_len", "64", "--dump_folder", str(folder),
                   *titan_args]
        run = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, f"{name}:\n{run.stdout[-4000:]}\n{run.stderr[-6000:]}"
        results[name] = json.loads(out.read_text())
    return results


def test_each_run_has_the_experts_it_asked_for(runs):
    assert runs["torchtitan"]["experts"] == {"RoutedExperts/GroupedExperts": 2}
    for name in ("megamoe_command_line", "megamoe_converters_list"):
        assert runs[name]["experts"] == {"MegamoeRoutedExperts/MegamoeGroupedExperts": 2}, name


def test_trainer_steps_run_and_losses_agree(runs):
    reference = runs["torchtitan"]["losses"]
    assert len(reference) == STEPS and reference[0] != reference[-1]  # the optimizer steps change the model
    for name, result in runs.items():
        assert result["steps_done"] == STEPS, name
        for step, (loss, want) in enumerate(zip(result["losses"], reference), 1):
            assert abs(loss - want) <= LOSS_AGREEMENT * abs(want), f"{name} step {step}: {loss} against {want}"
