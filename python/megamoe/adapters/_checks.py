"""Argument checks shared by the adapters: each message names the argument as the framework calls it (megamoe's own
checks name megamoe's arguments, e.g. topk_weights where torchtitan says topk_scores)."""

import contextlib
import re

import torch


def tensor(entry, name, value, dim=None):
    """TypeError unless `value` is a tensor; ValueError unless it has `dim` dimensions (when given)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{entry}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{entry}: {name} must have {dim} dimensions, got shape {tuple(value.shape)}")
    return value


def counts(entry, name, value, num_experts):
    """tokens per expert: an integer tensor [E]."""
    tensor(entry, name, value, 1)
    if value.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{entry}: {name} must be int32 or int64, got {value.dtype}")
    if value.shape[0] != num_experts:
        raise ValueError(f"{entry}: {name} has {value.shape[0]} entries for {num_experts} experts")
    return value


def rows(entry, name, value, num_rows, what):
    """A per-row tensor [R] of the `num_rows` rows of `what`."""
    tensor(entry, name, value, 1)
    if value.shape[0] != num_rows:
        raise ValueError(f"{entry}: {name} has {value.shape[0]} entries for the {num_rows} rows of {what}")
    return value


def routing(entry, x, scores_name, scores, ids_name, ids):
    """topk scores and ids [..., K] of the tokens of x [..., H] (the same leading shape, at least one dimension)."""
    tensor(entry, "x", x)
    tensor(entry, scores_name, scores)
    tensor(entry, ids_name, ids)
    if x.dim() < 2:
        raise ValueError(f"{entry}: x must have at least 2 dimensions ([..., H]), got shape {tuple(x.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{entry}: {ids_name} must be int32 or int64, got {ids.dtype}")
    if scores.shape != ids.shape:
        raise ValueError(f"{entry}: {scores_name} {tuple(scores.shape)} and {ids_name} {tuple(ids.shape)} differ")
    if ids.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"{entry}: {ids_name} {tuple(ids.shape)} does not have the leading shape of x "
                         f"{tuple(x.shape)} (tokens [..., K] for x [..., H])")


def scores_dtype(scores, x):
    """Routing scores as megamoe takes them: f32 or x's dtype (any other float dtype in f32)."""
    return scores if scores.dtype in (torch.float32, x.dtype) else scores.float()


@contextlib.contextmanager
def framework_names(entry, names):
    """Re-raise megamoe's ValueError / TypeError with its argument names replaced by the framework's (names: megamoe
    name -> framework name), prefixed by the adapter's entry point; other exceptions (NotImplementedError for what
    CUDA cannot run yet) pass unchanged."""
    try:
        yield
    except (ValueError, TypeError) as error:
        message = str(error)
        for ours, theirs in names.items():
            message = re.sub(rf"(?<![\w.]){re.escape(ours)}(?!\w)", theirs, message)
        raise type(error)(f"{entry}: {message}") from error
