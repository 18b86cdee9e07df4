"""torchtitan 0.2 on synthetic data (bench/titan_train.py with a torchtitan 0.2 release; also usable as
`--experimental.custom_import titan_legacy` when bench/ is on sys.path): importing this registers megamoe's model
converters ("megamoe", "megamoe.fp8") and train specs "<model>_synthetic" for qwen3 and deepseek_v3 (torchtitan's own
train specs with bench/titan_data.py's tokenizer-free synthetic data; no validator).

torchtitan 0.2's wheel ships no training configs, so TRAINING holds, per model of bench/titan_train.py, the settings of
torchtitan 0.3.0's config of the same name (batch, sequence length, optimizer, warmup capped as titan_configs.py
caps it, activation checkpointing, compile components), as torchtitan 0.2 command-line arguments.
"""

import copy
from dataclasses import replace

from titan_data import SyntheticBatches, VocabularyOnlyTokenizer, install_datasets_stand_in

install_datasets_stand_in()

import megamoe.adapters.torchtitan_module_converter  # noqa: E402,F401  (registers "megamoe", "megamoe.fp8")
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.protocols.train_spec import get_train_spec, register_train_spec  # noqa: E402

DATA_SEED = 0
MODELS = {  # bench/titan_train.py's model: (torchtitan 0.2 train spec, flavour)
    "qwen3_moe_debug": ("qwen3", "debugmodel_moe"),
    "qwen3_30b_a3b": ("qwen3", "30B-A3B"),
    "deepseek_v3_debug": ("deepseek_v3", "debugmodel"),
    "deepseek_v3_16b": ("deepseek_v3", "16B"),
}
COMMON = ["--metrics.log_freq", "1", "--debug.seed", str(DATA_SEED), "--optimizer.name", "AdamW"]
TRAINING = {  # torchtitan 0.3.0's settings of these configs
    "qwen3_moe_debug": ["--training.local_batch_size", "4", "--training.seq_len", "4096", "--optimizer.lr", "3e-4",
                        "--lr_scheduler.warmup_steps", "2", "--activation_checkpoint.mode", "selective"],
    "qwen3_30b_a3b": ["--training.local_batch_size", "2", "--training.seq_len", "4096", "--optimizer.lr", "8e-4",
                      "--lr_scheduler.warmup_steps", "20", "--activation_checkpoint.mode", "full"],
    "deepseek_v3_debug": ["--training.local_batch_size", "8", "--training.seq_len", "2048", "--optimizer.lr", "8e-4",
                          "--lr_scheduler.warmup_steps", "2", "--activation_checkpoint.mode", "selective"],
    "deepseek_v3_16b": ["--training.local_batch_size", "4", "--training.seq_len", "4096", "--optimizer.lr", "2.2e-4",
                        "--lr_scheduler.warmup_steps", "20", "--activation_checkpoint.mode", "selective",
                        "--compile.components", "loss"],
}


class SyntheticTokenizer(VocabularyOnlyTokenizer, BaseTokenizer):
    """A vocabulary size (titan_data.VocabularyOnlyTokenizer) and, for a model that masks attention at EOS tokens, the
    vocabulary's last id as its EOS."""

    def __init__(self, vocab_size, eos_id=None):
        super().__init__()
        self.vocab_size, self.eos_id = vocab_size, eos_id


class SyntheticLoader(BaseDataLoader):
    """titan_data.SyntheticBatches as a torchtitan 0.2 dataloader."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def state_dict(self):
        return self.batches.state_dict()

    def load_state_dict(self, state_dict):
        self.batches.load_state_dict(state_dict)


def _model_args(job_config):
    return get_train_spec(job_config.model.name).model_args[job_config.model.flavor]


def build_tokenizer(job_config):
    """DeepSeek-V3's flavours with flex attention mask documents at EOS tokens (`block_causal`): those get one."""
    args = _model_args(job_config)
    block_causal = getattr(args, "attn_mask_type", "causal") == "block_causal"
    return SyntheticTokenizer(args.vocab_size, args.vocab_size - 1 if block_causal else None)


def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **kwargs):
    training = job_config.training
    return SyntheticLoader(SyntheticBatches(_model_args(job_config).vocab_size, DATA_SEED, dp_rank, training.seq_len,
                                            training.local_batch_size, eos_id=tokenizer.eos_id))


def _register():
    for base in sorted({spec for spec, _ in MODELS.values()}):
        spec = get_train_spec(base)
        register_train_spec(f"{base}_synthetic", replace(spec, model_args=copy.deepcopy(dict(spec.model_args)),
                                                         build_tokenizer_fn=build_tokenizer,
                                                         build_dataloader_fn=build_dataloader,
                                                         build_validator_fn=None))


def cut_layers(spec_name, flavor, layers):
    """Keep the first `layers` layers of a registered synthetic train spec's flavour (its own copy of the args)."""
    get_train_spec(spec_name).model_args[flavor].n_layers = layers


def use_sdpa_attention(spec_name, flavor):
    """torchtitan's causal SDPA attention in place of the flavour's flex attention (DeepSeek-V3): no inductor autotuning
    of flex attention's kernels at start-up (minutes on an H100); every experts implementation of a comparison runs
    with the same attention."""
    args = get_train_spec(spec_name).model_args[flavor]
    args.attn_type, args.attn_mask_type = "sdpa", "causal"


def use_expert_loop(spec_name, flavor):
    """torchtitan 0.2's per-expert loop for its own experts (its grouped-mm path pads rows with a Triton kernel: on
    the CPU, this one)."""
    get_train_spec(spec_name).model_args[flavor].moe_args.use_grouped_mm = False


_register()
