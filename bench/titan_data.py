"""Synthetic data for torchtitan's trainer on a machine without network or tokenizer files (no torchtitan import
here: titan_configs.py wraps it for torchtitan 0.3, titan_legacy.py for 0.2).

SyntheticBatches: packed documents (64 to 1024 tokens) of a fixed random Markov chain over the vocabulary (each
token has four successors, drawn with probabilities 0.4 / 0.3 / 0.2 / 0.1: a model can learn it, so the loss falls
from ln(vocab) towards the chain's entropy, about 1.28 nats), yielded as torchtitan's text dataloader yields them:
({"input": [B, L], "positions": [B, L]}, labels [B, L]), positions restarting at each document, labels the next token
within the document. The same seed gives the same stream to every run (each data-parallel rank its own). With an
eos_id (the last id of the vocabulary, kept out of the chain), each document's last input is that token, its label
ignored (the token before it keeps its successor in the chain as its label): for models whose attention masks
documents at EOS tokens (torchtitan 0.2's DeepSeek-V3 flavours with flex attention, `block_causal`).

install_datasets_stand_in(): torchtitan's trainer imports Hugging Face `datasets` at module level for its HF
dataloaders (0.3: components/validate.py -> hf_datasets/text_datasets.py; 0.2 likewise). Where that package is not
installed, this registers a module under that name whose entry points raise; the runs use the synthetic data, never
those loaders.
"""

import importlib.util
import sys
import types

import torch

SUCCESSORS = 4
SUCCESSOR_PROBABILITIES = (0.4, 0.3, 0.2, 0.1)
DOCUMENT_LENGTHS = (64, 1024)  # the shortest and the longest document, in tokens
CHAINS = 1024  # distinct documents drawn per seed (each row picks documents from them, with random offsets)
IGNORE_INDEX = -100  # torchtitan's cross-entropy ignore index: the label of a document's closing EOS token


def install_datasets_stand_in():
    """Register a stand-in `datasets` package (load_dataset, split_dataset_by_node raise) unless it is installed;
    returns whether it did."""
    if "datasets" in sys.modules or importlib.util.find_spec("datasets") is not None:
        return False

    def unavailable(*args, **kwargs):
        raise RuntimeError("Hugging Face `datasets` is not installed here: torchtitan's HF dataloaders cannot run "
                           "(bench/titan_data.py's synthetic data needs none)")

    package = types.ModuleType("datasets")
    package.__doc__ = "Stand-in for the absent Hugging Face datasets package (bench/titan_data.py)."
    package.Dataset = type("Dataset", (), {})
    package.IterableDataset = type("IterableDataset", (), {})
    package.load_dataset = unavailable
    distributed = types.ModuleType("datasets.distributed")
    distributed.split_dataset_by_node = unavailable
    package.distributed = distributed
    sys.modules["datasets"] = package
    sys.modules["datasets.distributed"] = distributed
    return True


def markov_chains(vocab_size, seed, chains=CHAINS, length=DOCUMENT_LENGTHS[1] + 1):
    """[chains, length] int64 token sequences of the chain of `seed` (every run with this seed: the same)."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab_size, (vocab_size, SUCCESSORS), generator=gen)
    probabilities = torch.tensor(SUCCESSOR_PROBABILITIES)
    tokens = torch.empty(chains, length, dtype=torch.int64)
    tokens[:, 0] = torch.randint(vocab_size, (chains,), generator=gen)
    for position in range(1, length):
        choice = torch.multinomial(probabilities.expand(chains, -1), 1, replacement=True, generator=gen)[:, 0]
        tokens[:, position] = successors[tokens[:, position - 1], choice]
    return tokens


class VocabularyOnlyTokenizer:
    """What a torchtitan tokenizer does here (mixed into each release's BaseTokenizer: titan_configs.py for 0.3,
    titan_legacy.py for 0.2): a vocabulary size (self.vocab_size) and nothing else; the synthetic dataloader makes
    the token ids."""

    def encode(self, *args, **kwargs):
        raise NotImplementedError("SyntheticTokenizer encodes no text: the synthetic dataloader makes the token ids")

    def decode(self, *args, **kwargs):
        raise NotImplementedError("SyntheticTokenizer decodes no ids")

    def get_vocab_size(self):
        return self.vocab_size


class SyntheticBatches:
    """The batches of one data-parallel rank: rows of seq_len tokens packed from documents of markov_chains(vocab,
    seed), positions restarting at each document, labels the next token within the document. Iterating yields
    ({"input": [B, L], "positions": [B, L]}, labels [B, L]) without end; state_dict / load_state_dict resume it.
    eos_id (None, or vocab_size - 1): each document's last input token is eos_id, its label IGNORE_INDEX."""

    def __init__(self, vocab_size, seed, dp_rank, seq_len, batch_size, eos_id=None):
        if eos_id is not None and eos_id != vocab_size - 1:
            raise ValueError(f"eos_id must be the vocabulary's last id ({vocab_size - 1}), got {eos_id}")
        self.seq_len, self.batch_size, self.eos_id = seq_len, batch_size, eos_id
        self.chains = markov_chains(vocab_size if eos_id is None else vocab_size - 1, seed)
        self.gen = torch.Generator().manual_seed(seed * 1000003 + dp_rank)
        self.batches = 0

    def _row(self):
        """One row: documents until seq_len tokens (inputs, positions, labels), the last one cut."""
        inputs, positions, labels = [], [], []
        filled = 0
        while filled < self.seq_len:
            low, high = DOCUMENT_LENGTHS
            length = min(int(torch.randint(low, high + 1, (1,), generator=self.gen)), self.seq_len - filled)
            chain = int(torch.randint(self.chains.shape[0], (1,), generator=self.gen))
            start = int(torch.randint(self.chains.shape[1] - length, (1,), generator=self.gen))
            document = self.chains[chain, start:start + length + 1]
            if self.eos_id is None:
                inputs.append(document[:-1])
                labels.append(document[1:])
            else:  # every token's label its successor in the chain; the EOS closing the document has none
                inputs.append(torch.cat([document[:length - 1], torch.tensor([self.eos_id])]))
                labels.append(torch.cat([document[1:length], torch.tensor([IGNORE_INDEX])]))
            positions.append(torch.arange(length))
            filled += length
        return torch.cat(inputs), torch.cat(positions), torch.cat(labels)

    def __iter__(self):
        while True:
            rows = [self._row() for _ in range(self.batch_size)]
            self.batches += 1
            inputs, positions, labels = (torch.stack(column) for column in zip(*rows))
            yield {"input": inputs, "positions": positions}, labels

    def state_dict(self):
        return {"batches": self.batches, "generator": self.gen.get_state()}

    def load_state_dict(self, state_dict):
        self.batches = state_dict["batches"]
        self.gen.set_state(state_dict["generator"])
