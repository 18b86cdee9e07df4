"""Argument errors that keep their type and message under torch.compile(fullgraph=True).

Eagerly, megamoe's Python-side checks raise at once. While Dynamo traces a function, a raise in them would end the
trace with Dynamo's "Unsupported: Observed exception" (under fullgraph=True), which `except ValueError` does not
catch. So the entry points (megamoe.moe, megamoe.grouped_moe, the modules' forwards) catch their checks' errors (Dynamo
traces try / except) and return raise_argument_error(error, like): eagerly it raises the error again, at once;
while tracing it returns the output of the custom op
megamoe::argument_error, whose fake kernel gives a tensor shaped as `like` (the trace goes on) and whose real kernel
raises the error, of its type and with its message, when the compiled graph runs, where the eager call would have
raised. The library's own checks need none of this: they run inside the ops, when the graph runs.

    try:
        arguments = checked(...)                  # megamoe's checks: TypeError / ValueError / NotImplementedError
    except ARGUMENT_ERRORS as error:
        return raise_argument_error(error, x)     # eager: raised here and now; traced: by the compiled graph
"""

import torch

ARGUMENT_ERRORS = (TypeError, ValueError, NotImplementedError)
_ERROR_TYPES = {error.__name__: error for error in ARGUMENT_ERRORS}


@torch.library.custom_op("megamoe::argument_error", mutates_args=())
def argument_error(like: torch.Tensor, kind: str, message: str) -> torch.Tensor:
    """Raises `kind` (the name of one of ARGUMENT_ERRORS) with `message`; its fake kernel returns a tensor shaped as
    `like`."""
    raise _ERROR_TYPES.get(kind, ValueError)(message)


@argument_error.register_fake
def _(like, kind, message):
    return torch.empty_like(like)


def raise_argument_error(error, like=None):
    """What an entry point does with an argument error it caught: eagerly, raises it again; while torch.compile traces
    it, returns the output of megamoe::argument_error, which raises `error` (its type, its message) when the graph
    runs: a tensor shaped as `like` (a placeholder [0] where `like` is no tensor) for the trace."""
    if not torch.compiler.is_compiling():
        raise error
    like = like.detach() if isinstance(like, torch.Tensor) else torch.empty(0)
    message = str(error.args[0]) if error.args else ""
    return argument_error(like, _kind_of(error), message)


def _kind_of(error):
    """The name of error's type among ARGUMENT_ERRORS, by isinstance: Dynamo before torch 2.12 cannot trace a type's
    __name__."""
    for kind, error_type in _ERROR_TYPES.items():
        if isinstance(error, error_type):
            return kind
    return "ValueError"
