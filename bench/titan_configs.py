"""torchtitan config-registry functions for torchtitan's trainer on synthetic data (bench/titan_train.py; usable as
`--module titan_configs --config <name>` with torchtitan's own ConfigManager when bench/ is on sys.path).

Each is torchtitan 0.3.0's own config of that name (its model registry flavour, optimizer, schedule, batch, sequence
length, activation checkpointing, compile and parallelism settings) with only these changes: the tokenizer and the
dataloader are bench/titan_data.py's synthetic ones (no network, no tokenizer files), metrics are logged every step
(bench/titan_train.py keeps them), checkpointing is off, the seed is fixed (every run starts from the same weights), and the
warmup is at most WARMUP_STEPS (the 30B / 16B configs
warm up over 600 steps; a 200-step run would otherwise never reach the set learning rate). megamoe is switched on from
the command line (--override.imports megamoe.adapters.torchtitan_converter.megamoe_experts) or by the *_megamoe
functions (the converter in the model registry's converters list); torchtitan's own FP8 MoE path by *_torchao_fp8
(its Float8GroupedExpertsConverter, which needs torchao and an SM89+ GPU when the function runs).
"""

from dataclasses import dataclass

from titan_data import SyntheticBatches, VocabularyOnlyTokenizer, install_datasets_stand_in

install_datasets_stand_in()  # before torchtitan's trainer module is imported (it imports `datasets`)

from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.models.common.config_utils import decoder_vocab_size  # noqa: E402
from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3_registry  # noqa: E402
from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3_models  # noqa: E402
from torchtitan.models.qwen3 import config_registry as qwen3_registry  # noqa: E402
from torchtitan.models.qwen3 import model_registry as qwen3_models  # noqa: E402

WARMUP_STEPS = 20
DATA_SEED = 0


class SyntheticTokenizer(VocabularyOnlyTokenizer, BaseTokenizer):
    """A vocabulary size and nothing else (titan_data.VocabularyOnlyTokenizer)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048

    def __init__(self, config, tokenizer_path=None, **kwargs):
        super().__init__()
        self.vocab_size = config.vocab_size


class SyntheticTextLoader(BaseDataLoader):
    """titan_data.SyntheticBatches as a torchtitan 0.3 dataloader."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "synthetic"
        vocab_size: int = 2048
        seed: int = 0

    def __init__(self, config, *, dp_world_size=1, dp_rank=0, tokenizer=None, seq_len, local_batch_size, **kwargs):
        self.batches = SyntheticBatches(config.vocab_size, config.seed, dp_rank, seq_len, local_batch_size)

    def __iter__(self):
        return iter(self.batches)

    def state_dict(self):
        return self.batches.state_dict()

    def load_state_dict(self, state_dict):
        self.batches.load_state_dict(state_dict)


def synthetic(config, seed=DATA_SEED):
    """torchtitan's Trainer.Config with the synthetic tokenizer and data, per-step metrics, no checkpoints and at
    most WARMUP_STEPS of warmup."""
    vocab = decoder_vocab_size(config.model_spec)
    config.tokenizer = SyntheticTokenizer.Config(vocab_size=vocab)
    config.dataloader = SyntheticTextLoader.Config(vocab_size=vocab, seed=seed)
    config.hf_assets_path = ""
    config.metrics = MetricsProcessor.Config(log_freq=1)
    config.checkpoint.enable = False
    config.debug.seed = seed  # the same initial weights in every run (torchtitan draws a seed per run otherwise)
    config.lr_scheduler.warmup_steps = min(config.lr_scheduler.warmup_steps, WARMUP_STEPS)
    return config


def with_converters(config, registry, flavor, converters, **registry_kwargs):
    """config with its model spec rebuilt by the model registry with `converters` (the registry applies them)."""
    config.model_spec = registry(flavor, converters=converters, **registry_kwargs)
    return config


def _megamoe(precision="bf16"):
    from megamoe.adapters.torchtitan_converter import MegamoeConverter

    return [MegamoeConverter.Config(precision=precision)]


def _torchao_fp8(config):
    from torchtitan.components.quantization import Float8GroupedExpertsConverter

    compiled = config.compile.enable and "model" in config.compile.components
    return [Float8GroupedExpertsConverter.Config(model_compile_enabled=compiled)]


def qwen3_moe_debug():
    return synthetic(qwen3_registry.qwen3_moe_debug())


def qwen3_moe_debug_megamoe():
    return synthetic(with_converters(qwen3_registry.qwen3_moe_debug(), qwen3_models, "debugmodel_moe", _megamoe()))


def qwen3_30b_a3b():
    return synthetic(qwen3_registry.qwen3_30b_a3b())


def qwen3_30b_a3b_megamoe():
    return synthetic(with_converters(qwen3_registry.qwen3_30b_a3b(), qwen3_models, "30B-A3B", _megamoe()))


def qwen3_30b_a3b_torchao_fp8():
    config = qwen3_registry.qwen3_30b_a3b()
    return synthetic(with_converters(config, qwen3_models, "30B-A3B", _torchao_fp8(config)))


def deepseek_v3_debugmodel():
    return synthetic(deepseek_v3_registry.deepseek_v3_debugmodel())


def deepseek_v3_16b():
    return synthetic(deepseek_v3_registry.deepseek_v3_16b())


def deepseek_v3_16b_torchao_fp8():
    config = deepseek_v3_registry.deepseek_v3_16b()
    return synthetic(with_converters(config, deepseek_v3_models, "16B", _torchao_fp8(config)))
