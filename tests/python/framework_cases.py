"""Shared pieces of the tests against the frameworks' own code (test_frameworks_*.py): the releases that
scripts/install_frameworks.sh installed (.frameworks/manifest.tsv), one of them put on sys.path per process, the
others run in a subprocess; a float64 shim that makes the frameworks' own casts to f32 / bf16 no-ops; the gradients
of two modules compared parameter by parameter."""

import contextlib
import csv
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adapter_cases import assert_close

FRAMEWORKS = Path(os.environ.get("MEGAMOE_FRAMEWORKS", Path(__file__).resolve().parents[2] / ".frameworks"))
RELEASE_VARIABLE = "MEGAMOE_FRAMEWORK_RELEASE"  # "<package>-<version>": the release a subprocess tests


def _manifest():
    """{(package, role): (version, status)} of .frameworks/manifest.tsv (empty when the script has not run)."""
    path = FRAMEWORKS / "manifest.tsv"
    if not path.exists():
        return {}
    with open(path, newline="") as rows:
        return {(row["package"], row["role"]): (row["version"], row["status"])
                for row in csv.DictReader(rows, delimiter="\t")}


def _not_installed(package):
    """Skip (fail under CI, whose scripts/test.sh runs the installer) when the installer has not run."""
    reason = f"{package} is not installed: run scripts/install_frameworks.sh (it fills {FRAMEWORKS})"
    if os.environ.get("CI"):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def load_release(package, module):
    """Put one release of `package` first on sys.path (the pinned one, or the MEGAMOE_FRAMEWORK_RELEASE a
    subprocess was started with), import `module` from it and return its version; skips the calling test module,
    with the manifest's reason, where that release could not install."""
    manifest = _manifest()
    if (package, "pinned") not in manifest:
        _not_installed(package)
    wanted = os.environ.get(RELEASE_VARIABLE, "")
    version, status = manifest[(package, "pinned")]
    if wanted.startswith(package + "-"):
        version, status = wanted[len(package) + 1:], "ok"
    if status != "ok":
        pytest.skip(f"{package} {version}: {status}", allow_module_level=True)
    sys.path.insert(0, str(FRAMEWORKS / f"{package}-{version}"))
    imported = importlib.import_module(module)
    origin = Path(imported.__file__).resolve()
    assert FRAMEWORKS.resolve() in origin.parents, f"{module} was imported from {origin}, not {FRAMEWORKS}"
    return version


def other_releases(package):
    """pytest params of the releases of `package` other than the pinned one: (role, version, status)."""
    manifest = _manifest()
    pinned = manifest.get((package, "pinned"), ("-", ""))[0]
    params = []
    for (name, role), (version, status) in sorted(manifest.items()):
        if name == package and role != "pinned":
            same = version == pinned and status == "ok"
            params.append(pytest.param(role, version, "the pinned release" if same else status, id=role))
    return params or [pytest.param("-", "-", "no release installed", id="none")]


def run_release(test_file, package, role, version, status):
    """Run `test_file` in a subprocess with `version` of `package` on sys.path (in this process, the pinned one is);
    skips with the manifest's reason where that release could not install or is the pinned one."""
    if os.environ.get(RELEASE_VARIABLE):
        pytest.skip("the subprocess of one release runs no other release")
    if status != "ok":
        pytest.skip(f"{package} {role} {version}: {status}")
    env = {**os.environ, RELEASE_VARIABLE: f"{package}-{version}"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", test_file],
                         cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{package} {version} ({role}):\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
    assert " passed" in run.stdout.splitlines()[-1], run.stdout[-3000:]


_LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_mm_float64(grouped_mm):
    """torch._grouped_mm (2D A [R, K], 3D B [G, K, N], offs: each group's end row) extended to float64 (torch's CPU
    kernel takes f32 / bf16 / f16 only): one matmul per group, rows past the last offset 0."""

    def call(a, b, *args, offs=None, **kwargs):
        if a.dtype != torch.float64:
            return grouped_mm(a, b, *args, offs=offs, **kwargs)
        ends = offs.tolist()
        sizes = [end - start for start, end in zip([0] + ends[:-1], ends)] + [a.shape[0] - ends[-1]]
        groups = a.split(sizes)  # split / unbind: their backwards are one cat / stack (not a zeros per group)
        rows = [rows @ weight for rows, weight in zip(groups, b.unbind(0))]
        return torch.cat(rows + [a.new_zeros(sizes[-1], b.shape[-1])])  # [R, N]

    return call


def _histc_of_integers(histc):
    """torch.histc taking integer tensors on the CPU as it does on CUDA (torchtitan 0.2 counts expert ids with it)."""

    def call(values, *args, **kwargs):
        if values.is_floating_point():
            return histc(values, *args, **kwargs)
        return histc(values.double(), *args, **kwargs).to(values.dtype)

    return call


@contextlib.contextmanager
def float64_shim():
    """The frameworks cast to bf16 / f32 around their GEMMs and combines; in here a float64 tensor's cast to a lower
    precision (Tensor.to(dtype), .float(), .bfloat16()) returns the tensor itself, and torch._grouped_mm takes
    float64: every operation stays the framework's own, computed in float64. Other casts are untouched. torch.histc
    also counts integer ids on the CPU (as on CUDA)."""
    to, to_float, to_bf16, grouped_mm = torch.Tensor.to, torch.Tensor.float, torch.Tensor.bfloat16, torch._grouped_mm
    histc = torch.histc

    def keep_to(self, *args, **kwargs):
        dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
        only_dtype = len(args) + len(kwargs) == 1
        if self.dtype == torch.float64 and dtype in _LOW_PRECISION and only_dtype:
            return self
        return to(self, *args, **kwargs)

    torch.Tensor.to = keep_to
    torch.Tensor.float = lambda self, *a, **k: self if self.dtype == torch.float64 else to_float(self, *a, **k)
    torch.Tensor.bfloat16 = lambda self, *a, **k: self if self.dtype == torch.float64 else to_bf16(self, *a, **k)
    torch._grouped_mm = _grouped_mm_float64(grouped_mm)
    torch.histc = _histc_of_integers(histc)
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.Tensor.bfloat16 = to, to_float, to_bf16
        torch._grouped_mm, torch.histc = grouped_mm, histc


def module_grads(module, call, inputs, dout, rename=None):
    """{"out": call(), each input name, each parameter name (renamed by `rename`): d<dout, out>/d it}."""
    names = [name for name, _ in module.named_parameters()]
    out = call()
    out = out[0] if isinstance(out, tuple) else out
    leaves = list(inputs.values()) + [param for _, param in module.named_parameters()]
    computed = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    names = list(inputs) + [rename(name) if rename else name for name in names]
    return {"out": out.detach(), **dict(zip(names, computed))}


def assert_modules_agree(ours, theirs, unused=(), bound=1e-10):
    """Every gradient of both present (None only for the names in `unused`, in both), equal within `bound`."""
    for name in unused:
        assert ours.pop(name) is None and theirs.pop(name) is None, name
    assert_close(ours, theirs, bound)
