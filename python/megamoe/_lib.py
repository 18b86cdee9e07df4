"""ctypes binding of the C API in include/megamoe/megamoe.h (no compilation against torch).

This module only converts torch tensors into `megamoe_tensor_t` views, calls the library and turns a
failed status into a Python exception carrying the library's message (which names the argument).
Loading checks the library's ABI (megamoe_abi_version, megamoe_struct_size) against the ctypes structs below
and refuses a library built from other declarations with an ImportError naming it and both versions.

Every call takes its tensors by the params structs' field names and the experts' options (layout, activation and
precision, layouts.py) as the dict `options` of layouts.op_options(); path() asks which implementation a call would run
(a Path: the name, and the reason when the call's expert options keep it off the fused sm_90a kernels). A CUDA call
that runs on the portable kernels for that reason warns once per combination of options (warn_portable_once).
The FP8 expert weights of precision "fp8" (megamoe_fp8_experts_t, the params structs' `fp8`) go by the names of
FP8_ARGS, fp8_<field> (fp8_w13 for fp8.w13, ...); quantize_experts_into writes them (megamoe_quantize_experts).
"""

import ctypes
import os
import pathlib
import warnings

import torch

MAX_DIMS = 4
ABI_VERSION = 5  # MEGAMOE_ABI_VERSION of include/megamoe/megamoe.h that the structs below declare

STATUS_SUCCESS = 0
STATUS_INVALID_ARGUMENT = 1
STATUS_NOT_SUPPORTED = 2
STATUS_WORKSPACE_TOO_SMALL = 3

DEVICE_CPU = 0
DEVICE_CUDA = 1

ACCUM_DEFAULT = 0

GATE_UP_CODES = {"concatenated": 0, "interleaved": 1, "separate": 2}  # megamoe_gate_up_t
ACTIVATION_CODES = {"swiglu": 0, "clamped_swiglu": 1}  # megamoe_activation_kind_t
PATH_NAMES = {0: "reference", 1: "cuda", 2: "sm90", 3: "sm90+cuda-weight-grads", 4: "sm90-fp8"}  # megamoe_path_t
PRECISION_CODES = {"bf16": 0, "fp8": 1}  # megamoe_precision_t: DEFAULT (the dtype of x), FP8_BLOCKWISE

_DTYPE_CODES = {
    torch.bfloat16: 0,
    torch.float16: 1,
    torch.float32: 2,
    torch.float64: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.float8_e4m3fn: 6,  # the FP8 expert weights only
}


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("strides", ctypes.c_int64 * MAX_DIMS),
        ("device_type", ctypes.c_int),
        ("device_index", ctypes.c_int32),
    ]


class CLayout(ctypes.Structure):
    _fields_ = [
        ("gate_up", ctypes.c_int),
        ("w13_transposed", ctypes.c_int32),
        ("w2_transposed", ctypes.c_int32),
    ]


class CActivation(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("limit", ctypes.c_double),
        ("alpha", ctypes.c_double),
    ]


# megamoe_fp8_experts_t: the FP8 weights of precision FP8_BLOCKWISE, e4m3 but the f32 scales (fp8.Fp8Experts's fields).
FP8_FIELDS = ("w13", "w13_t", "w13_scales", "w2", "w2_t", "w2_scales")
FP8_ARGS = tuple(f"fp8_{name}" for name in FP8_FIELDS)  # their names as call tensors and op arguments


class CFp8Experts(ctypes.Structure):
    _fields_ = [(name, Tensor) for name in FP8_FIELDS]


# Appended to every params struct: the expert parameters beyond w13 / w2 and their options; the backward's also
# carry the gradients of w3, b13 and b2 before the options.
_EXPERT_FIELDS = [("w3", Tensor), ("b13", Tensor), ("b2", Tensor)]
_EXPERT_GRAD_FIELDS = [("dw3", Tensor), ("db13", Tensor), ("db2", Tensor)]
_OPTION_FIELDS = [("layout", CLayout), ("activation", CActivation)]
# accumulation precision, the caller's workspace and stream: after the tensors of every params struct
_RUN_FIELDS = [("accum", ctypes.c_int), ("workspace", ctypes.c_void_p), ("workspace_bytes", ctypes.c_size_t),
               ("stream", ctypes.c_void_p)]
# the last fields of every params struct: the GEMMs' precision and the FP8 weights
_PRECISION_FIELDS = [("precision", ctypes.c_int), ("fp8", CFp8Experts)]


class ForwardParams(ctypes.Structure):
    _fields_ = [
        ("x", Tensor),
        ("topk_ids", Tensor),
        ("topk_weights", Tensor),
        ("w13", Tensor),
        ("w2", Tensor),
        ("y", Tensor),
        ("saved_h", Tensor),
        *_RUN_FIELDS,
        *_EXPERT_FIELDS,
        *_OPTION_FIELDS,
        *_PRECISION_FIELDS,
    ]


class BackwardParams(ctypes.Structure):
    _fields_ = [
        ("dy", Tensor),
        ("x", Tensor),
        ("topk_ids", Tensor),
        ("topk_weights", Tensor),
        ("w13", Tensor),
        ("w2", Tensor),
        ("saved_h", Tensor),
        ("dx", Tensor),
        ("dtopk_weights", Tensor),
        ("dw13", Tensor),
        ("dw2", Tensor),
        *_RUN_FIELDS,
        *_EXPERT_FIELDS,
        *_EXPERT_GRAD_FIELDS,
        *_OPTION_FIELDS,
        ("accumulate_weight_grads", ctypes.c_int32),
        *_PRECISION_FIELDS,
    ]


class GroupedForwardParams(ctypes.Structure):
    _fields_ = [
        ("x_sorted", Tensor),
        ("tokens_per_expert", Tensor),
        ("scores", Tensor),
        ("w13", Tensor),
        ("w2", Tensor),
        ("out", Tensor),
        ("saved_h", Tensor),
        *_RUN_FIELDS,
        *_EXPERT_FIELDS,
        *_OPTION_FIELDS,
        *_PRECISION_FIELDS,
    ]


class GroupedBackwardParams(ctypes.Structure):
    _fields_ = [
        ("dout", Tensor),
        ("x_sorted", Tensor),
        ("tokens_per_expert", Tensor),
        ("scores", Tensor),
        ("w13", Tensor),
        ("w2", Tensor),
        ("saved_h", Tensor),
        ("dx_sorted", Tensor),
        ("dscores", Tensor),
        ("dw13", Tensor),
        ("dw2", Tensor),
        *_RUN_FIELDS,
        *_EXPERT_FIELDS,
        *_EXPERT_GRAD_FIELDS,
        *_OPTION_FIELDS,
        ("accumulate_weight_grads", ctypes.c_int32),
        *_PRECISION_FIELDS,
    ]


# megamoe_struct_kind_t code -> the ctypes struct that must have the library's size for it.
ABI_STRUCTS = {
    0: Tensor,
    1: ForwardParams,
    2: BackwardParams,
    3: GroupedForwardParams,
    4: GroupedBackwardParams,
    5: CLayout,
    6: CActivation,
    7: CFp8Experts,
}

_ENTRY_POINTS = (
    ("forward", ForwardParams),
    ("backward", BackwardParams),
    ("grouped_forward", GroupedForwardParams),
    ("grouped_backward", GroupedBackwardParams),
)


def _candidates():
    here = pathlib.Path(__file__).resolve().parent
    yield here / "lib" / "libmegamoe.so"  # where the wheel (pip install) puts it
    yield here.parent.parent / "build" / "libmegamoe.so"  # a CMake build of this checkout


def library_path():
    """The libmegamoe.so to load: the file MEGAMOE_LIBRARY names when it is set (ImportError naming it when it is not
    a file: never another library in its place), else the installed one, else a CMake build of this checkout."""
    env = os.environ.get("MEGAMOE_LIBRARY")
    if env:
        path = pathlib.Path(env)
        if not path.is_file():
            raise ImportError(f"megamoe: MEGAMOE_LIBRARY={env}: {'a directory' if path.is_dir() else 'no such file'}"
                              "; name a libmegamoe.so, or unset MEGAMOE_LIBRARY to load the installed one")
        return path
    tried = list(_candidates())
    for path in tried:
        if path.is_file():
            return path
    raise ImportError(
        "megamoe: libmegamoe.so not found (tried: " + ", ".join(map(str, tried)) + "). Install with "
        "`pip install .`, build with CMake into build/, or set MEGAMOE_LIBRARY."
    )


_LIB = None


def library():
    """The loaded shared library (loaded once, on first use)."""
    global _LIB
    if _LIB is None:
        path = library_path()
        lib = ctypes.CDLL(str(path))
        check_abi(lib, path)
        lib.megamoe_last_error.restype = ctypes.c_char_p
        lib.megamoe_path_reason.restype = ctypes.c_char_p
        lib.megamoe_version.restype = ctypes.c_int32
        for name, params in _ENTRY_POINTS:
            getattr(lib, f"megamoe_{name}").argtypes = [ctypes.POINTER(params)]
            getattr(lib, f"megamoe_{name}").restype = ctypes.c_int
            size_fn = getattr(lib, f"megamoe_{name}_workspace_size")
            size_fn.argtypes = [ctypes.POINTER(params), ctypes.POINTER(ctypes.c_size_t)]
            size_fn.restype = ctypes.c_int
            path_fn = getattr(lib, f"megamoe_{name}_path")
            path_fn.argtypes = [ctypes.POINTER(params), ctypes.POINTER(ctypes.c_int)]
            path_fn.restype = ctypes.c_int
        if hasattr(lib, "megamoe_quantize_experts"):
            lib.megamoe_quantize_experts.argtypes = [ctypes.POINTER(Tensor), ctypes.POINTER(Tensor),
                                                     ctypes.POINTER(CFp8Experts), ctypes.c_void_p]
            lib.megamoe_quantize_experts.restype = ctypes.c_int
        _LIB = lib
    return _LIB


# The C API's test overrides (megamoe.h: megamoe_test_override_t): force a choice the library otherwise makes itself,
# for tests. Not for production use.
TEST_PORTABLE_WEIGHT_GRADS = 1  # the sm_90a backward's weight gradients on the portable kernel
TEST_FP8_FORWARD_ONLY = 2  # an FP8 call's backward in the element type
TEST_FP8_BACKWARD_ONLY = 4  # an FP8 call's forward in the element type
TEST_FP8_OPERANDS_IN_WORKSPACE = 8  # the FP8 backward's dy and dh copies in the workspace, not in dw13
TEST_PAIR_BLOCKS = 16  # the sm_90a M-grouped tile order in pair blocks at every launch (builds that form them)


def set_test_overrides(overrides):
    """Sets the library's test overrides (a bitwise OR of the TEST_* values; 0 restores its own choices) and returns
    the previous ones. Process-wide."""
    lib = library()
    lib.megamoe_testing_overrides.restype = ctypes.c_uint32
    lib.megamoe_testing_set_overrides.argtypes = [ctypes.c_uint32]
    previous = lib.megamoe_testing_overrides()
    lib.megamoe_testing_set_overrides(int(overrides))
    return previous


def has_cuda():
    """Whether the loaded library has its CUDA code (False: a CPU-only build, made without nvcc, which runs the CPU
    reference and refuses CUDA tensors; a library without megamoe_has_cuda predates CPU-only builds: True)."""
    lib = library()
    if not hasattr(lib, "megamoe_has_cuda"):
        return True
    lib.megamoe_has_cuda.restype = ctypes.c_int32
    return bool(lib.megamoe_has_cuda())


def version():
    """The loaded library's version, "MAJOR.MINOR.PATCH" (megamoe_version(); the wheel's metadata has the same one: both
    come from include/megamoe/megamoe.h)."""
    code = library().megamoe_version()
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def check_abi(lib, path):
    """Refuse (ImportError) a library whose ABI version or struct sizes differ from what this binding declares."""
    if not hasattr(lib, "megamoe_abi_version") or not hasattr(lib, "megamoe_struct_size"):
        raise ImportError(
            f"megamoe: {path} has no ABI version (no megamoe_abi_version: built before the ABI guard); this binding "
            f"expects ABI version {ABI_VERSION}. Rebuild the library from this checkout or reinstall megamoe."
        )
    lib.megamoe_abi_version.restype = ctypes.c_int32
    lib.megamoe_abi_version.argtypes = []
    lib.megamoe_struct_size.restype = ctypes.c_size_t
    lib.megamoe_struct_size.argtypes = [ctypes.c_int]
    version = lib.megamoe_abi_version()
    have = {struct.__name__: lib.megamoe_struct_size(kind) for kind, struct in ABI_STRUCTS.items()}
    want = {struct.__name__: ctypes.sizeof(struct) for struct in ABI_STRUCTS.values()}
    if version != ABI_VERSION or have != want:
        raise ImportError(
            f"megamoe: {path} has ABI version {version} (struct sizes {have}); this binding expects ABI version "
            f"{ABI_VERSION} (struct sizes {want}). Rebuild the library from this checkout or reinstall megamoe."
        )


# What each argument's dtype may be, for the message that refuses one the library cannot even be told about (the
# library checks the rest, e.g. that w13 has the dtype of x). Any other name: a row or weight tensor.
_INDEX_DTYPES = "int32 or int64"
_ROW_WEIGHT_DTYPES = "float32 or the dtype of the rows (bf16, f16, f32, f64)"
_FLOAT_DTYPES = "bf16, f16, f32 or f64 (bf16 / f16 on CUDA)"
ALLOWED_DTYPES = {"topk_ids": _INDEX_DTYPES, "tokens_per_expert": _INDEX_DTYPES, "topk_weights": _ROW_WEIGHT_DTYPES,
                  "scores": _ROW_WEIGHT_DTYPES, "dtopk_weights": _ROW_WEIGHT_DTYPES, "dscores": _ROW_WEIGHT_DTYPES,
                  **{name: "float8_e4m3fn" for name in ("fp8_w13", "fp8_w13_t", "fp8_w2", "fp8_w2_t", "fp8.w13",
                                                        "fp8.w13_t", "fp8.w2", "fp8.w2_t")},
                  **{name: "float32" for name in ("fp8_w13_scales", "fp8_w2_scales", "fp8.w13_scales",
                                                  "fp8.w2_scales")}}


def check_arg(name, tensor):
    """What must hold before a tensor can even be described to the library (type, dtype, rank, device)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"megamoe: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _DTYPE_CODES:
        raise TypeError(f"megamoe: {name} has dtype {tensor.dtype}; allowed: {ALLOWED_DTYPES.get(name, _FLOAT_DTYPES)}")
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"megamoe: {name} has {tensor.dim()} dimensions; at most {MAX_DIMS}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"megamoe: {name} is on {tensor.device}; only cpu and cuda tensors are supported")


def view(name, tensor):
    """A megamoe_tensor_t describing `tensor` (None gives the absent tensor)."""
    out = Tensor()
    if tensor is None:
        return out
    check_arg(name, tensor)
    ndim = tensor.dim()
    out.data = tensor.data_ptr() or None
    out.dtype = _DTYPE_CODES[tensor.dtype]
    out.ndim = ndim
    out.shape[:ndim] = tensor.shape  # one slice assignment each: this runs for every tensor of every call
    out.strides[:ndim] = tensor.stride()
    if tensor.is_cuda:
        out.device_type = DEVICE_CUDA
        out.device_index = tensor.device.index or 0
    else:
        out.device_type = DEVICE_CPU
    return out


# The C API's words in its messages -> what a Python caller passed.
_PYTHON_WORDS = {"precision: FP8_BLOCKWISE": 'precision="fp8"'}


def python_message(message):
    """A library message in the Python API's words (precision="fp8" where the C API says FP8_BLOCKWISE)."""
    for c_words, python_words in _PYTHON_WORDS.items():
        message = message.replace(c_words, python_words)
    return message


def check(status):
    """Raise the exception matching a non-success status, with the library's message."""
    if status == STATUS_SUCCESS:
        return
    message = "megamoe: " + python_message(library().megamoe_last_error().decode())
    if status == STATUS_INVALID_ARGUMENT:
        raise ValueError(message)
    if status == STATUS_NOT_SUPPORTED:
        raise NotImplementedError(message)
    raise RuntimeError(message)


def set_options(params, gate_up="concatenated", w13_transposed=False, w2_transposed=False, activation="swiglu",
                limit=0.0, alpha=0.0, precision="bf16"):
    """The layout, activation and precision fields of a params struct (the keyword arguments of layouts.op_options());
    an unknown name raises ValueError naming the argument."""
    if gate_up not in GATE_UP_CODES:
        raise ValueError(f"megamoe: gate_up: unknown arrangement {gate_up!r} (one of {', '.join(GATE_UP_CODES)})")
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"megamoe: activation: unknown activation {activation!r} (one of "
                         f"{', '.join(ACTIVATION_CODES)})")
    params.layout.gate_up = GATE_UP_CODES[gate_up]
    params.layout.w13_transposed = int(bool(w13_transposed))
    params.layout.w2_transposed = int(bool(w2_transposed))
    params.activation.kind = ACTIVATION_CODES[activation]
    params.activation.limit = float(limit)
    params.activation.alpha = float(alpha)
    params.precision = precision_code(precision)


def precision_code(precision):
    """megamoe_precision_t of a precision name (PRECISION_CODES); ValueError naming `precision` for another."""
    if not isinstance(precision, str) or precision not in PRECISION_CODES:
        raise ValueError(f"megamoe: precision: unknown precision {precision!r} (one of {', '.join(PRECISION_CODES)})")
    return PRECISION_CODES[precision]


_PARAMS = dict(_ENTRY_POINTS)


def params_of(kind, tensors, options=None, **fields):
    """The params struct of entry point `kind` ("forward", "backward", "grouped_forward", "grouped_backward") with
    `tensors` (field name -> torch.Tensor or None: absent; fp8_<field> for the struct's fp8.<field>), the options dict
    (None: the defaults) and scalar `fields` (e.g. accumulate_weight_grads=1)."""
    params = _PARAMS[kind]()
    for name, tensor in tensors.items():
        if name in FP8_ARGS:
            if tensor is not None:  # absent: the struct's zeros already
                setattr(params.fp8, name[len("fp8_"):], view(name, tensor))
        else:
            setattr(params, name, view(name, tensor))
    set_options(params, **(options or {}))
    for name, value in fields.items():
        setattr(params, name, value)
    return params


def call(kind, tensors, options=None, **fields):
    """Run entry point `kind` on `tensors` (outputs among them, written in place), on the device of its first one."""
    device = next(t for t in tensors.values() if t is not None).device
    params = params_of(kind, tensors, options, **fields)
    if device.type == "cuda":
        warn_portable_once(kind, params, tensors, options, device)
    _run(kind, params, device)


class Path(str):
    """The name of an implementation (PATH_NAMES; compares equal to it) with `reason`: why a call the fused sm_90a
    kernels would run takes the portable CUDA kernels (the expert parameter that keeps it off them: a misaligned w3 or
    bias), else None."""

    def __new__(cls, name, reason=None):
        path = super().__new__(cls, name)
        path.reason = reason
        return path

    def __repr__(self):
        return f"Path({str(self)!r}, reason={self.reason!r})"


def _query_path(kind, params):
    code = ctypes.c_int(0)
    check(getattr(library(), f"megamoe_{kind}_path")(ctypes.byref(params), ctypes.byref(code)))
    reason = library().megamoe_path_reason().decode() or None
    return Path(PATH_NAMES.get(code.value, f"unknown ({code.value})"), reason)


def path(kind, tensors, options=None):
    """The implementation (a Path: its name, PATH_NAMES, and the reason when the expert options keep the call off the
    fused sm_90a kernels) entry point `kind` would run for these tensors and options."""
    return _query_path(kind, params_of(kind, tensors, options))


_checked_portable = set()  # (device, options, which optional expert tensors) already checked
_DEFAULT_OPTIONS = dict(gate_up="concatenated", w13_transposed=False, w2_transposed=False, activation="swiglu",
                        limit=0.0, alpha=0.0, precision="bf16")


def warn_portable_once(kind, params, tensors, options, device):
    """Warns once per device and combination of expert options when they send a CUDA call to the portable kernels
    where the fused sm_90a ones would run it (the default options are never checked: no path query)."""
    experts = tuple(name for name in ("w3", "b13", "b2") if tensors.get(name) is not None)
    if (not options or options == _DEFAULT_OPTIONS) and not experts:
        return
    key = (device.index, tuple(sorted((options or {}).items())), experts)
    if key in _checked_portable:
        return
    _checked_portable.add(key)
    reason = _query_path(kind, params).reason
    if reason:
        warnings.warn(f"megamoe: {reason}", stacklevel=3)


def forward_into(x, topk_ids, topk_weights, w13, w2, y, saved_h=None, options=None, **experts):
    """megamoe_forward writing into the caller's y [T, H] (and h = [g, u] into saved_h [T*topk, 2I] if given);
    experts: w3, b13, b2 (absent: None) and, with options' precision "fp8", the FP8 weights fp8_w13, ... (FP8_ARGS)."""
    call("forward", dict(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w2=w2, y=y, saved_h=saved_h,
                         **experts), options)


def backward_into(dy, x, topk_ids, topk_weights, w13, w2, dx, dtopk_weights, dw13, dw2, saved_h=None, options=None,
                  accumulate=False, **experts):
    """megamoe_backward writing into the caller's gradients (None = not wanted); saved_h: the forward's, or None;
    experts: w3, b13, b2 and their gradients dw3, db13, db2; accumulate: the weight and bias gradients are added into
    the given (f32) dw13, dw2, dw3, db13, db2 (accumulate_weight_grads); the FP8 weights as for forward_into."""
    call("backward", dict(dy=dy, x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w2=w2, saved_h=saved_h,
                          dx=dx, dtopk_weights=dtopk_weights, dw13=dw13, dw2=dw2, **experts), options,
         accumulate_weight_grads=int(bool(accumulate)))


def grouped_forward_into(x_sorted, tokens_per_expert, scores, w13, w2, out, saved_h=None, options=None, **experts):
    """megamoe_grouped_forward writing into the caller's out [R, H] (and h into saved_h [R, 2I] if given);
    scores None: no per-row scale."""
    call("grouped_forward", dict(x_sorted=x_sorted, tokens_per_expert=tokens_per_expert, scores=scores, w13=w13,
                                 w2=w2, out=out, saved_h=saved_h, **experts), options)


def grouped_backward_into(dout, x_sorted, tokens_per_expert, scores, w13, w2, dx_sorted, dscores, dw13, dw2,
                          saved_h=None, options=None, accumulate=False, **experts):
    """megamoe_grouped_backward writing into the caller's gradients (None = not wanted; dscores needs scores);
    accumulate as for backward_into."""
    call("grouped_backward", dict(dout=dout, x_sorted=x_sorted, tokens_per_expert=tokens_per_expert, scores=scores,
                                  w13=w13, w2=w2, saved_h=saved_h, dx_sorted=dx_sorted, dscores=dscores, dw13=dw13,
                                  dw2=dw2, **experts), options, accumulate_weight_grads=int(bool(accumulate)))


def _run(kind, params, device):
    """Query the workspace, allocate it through torch, launch on the current stream."""
    lib = library()
    size = ctypes.c_size_t(0)
    check(getattr(lib, f"megamoe_{kind}_workspace_size")(ctypes.byref(params), ctypes.byref(size)))
    workspace = None
    if size.value:
        workspace = torch.empty(size.value, dtype=torch.uint8, device=device)
        params.workspace = workspace.data_ptr()
        params.workspace_bytes = size.value
    if device.type == "cuda":
        params.stream = torch.cuda.current_stream(device).cuda_stream
    check(getattr(lib, f"megamoe_{kind}")(ctypes.byref(params)))
    del workspace  # freed only after the launch is queued; the caching allocator orders reuse on the stream


def quantize_experts_into(w13, w2, fp8_tensors):
    """megamoe_quantize_experts: the blockwise FP8 copies of w13 [E, 2I, H] and w2 [E, H, I] (CUDA, contiguous, the
    default layout) written into fp8_tensors, the six tensors of FP8_FIELDS in that order (an fp8.Fp8Experts: w13
    [E, 2I, H], w13_t [E, H, 2I] e4m3, w13_scales [E, 2I / 128, H / 128] f32, w2 [E, H, I], w2_t [E, I, H] e4m3,
    w2_scales [E, H / 128, I / 128] f32; w13_t / w2_t None: absent, not written), on the current stream."""
    lib = library()
    if not hasattr(lib, "megamoe_quantize_experts"):
        raise NotImplementedError(f"megamoe: {lib._name} has no megamoe_quantize_experts (a library without the FP8 "
                                  "weights' quantization)")
    fp8_tensors = tuple(fp8_tensors)
    if len(fp8_tensors) != len(FP8_FIELDS):
        raise ValueError(f"megamoe: fp8 tensors: {len(fp8_tensors)} given, expected {len(FP8_FIELDS)} "
                         f"({', '.join(FP8_FIELDS)})")
    fp8 = CFp8Experts()
    for name, tensor in zip(FP8_FIELDS, fp8_tensors):
        setattr(fp8, name, view(f"fp8.{name}", tensor))
    w13_view, w2_view = view("w13", w13), view("w2", w2)
    stream = torch.cuda.current_stream(w13.device).cuda_stream if w13.is_cuda else None
    check(lib.megamoe_quantize_experts(ctypes.byref(w13_view), ctypes.byref(w2_view), ctypes.byref(fp8), stream))
