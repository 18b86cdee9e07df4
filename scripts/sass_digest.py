"""A digest of every kernel's SASS in a built library, to show that a change which should not alter the device code
(a file move, a rename, a comment) did not: one line per kernel, its instruction count and a hash of its instructions
(addresses, encodings and the anonymous namespace's per-file hash left out, so moving a file keeps the digest).

    python3 scripts/sass_digest.py build/libmegamoe.so > before.txt   # then after the change, and diff the two

cuobjdump comes from the CUDA toolkit, or the copy Triton ships (found on PATH or beside the triton package).
"""
import hashlib
import pathlib
import re
import shutil
import subprocess
import sys


def cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
        candidate = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    sys.exit("cuobjdump not found (CUDA toolkit or the triton package)")


def digests(library):
    text = subprocess.run([cuobjdump(), "-sass", library], check=True, capture_output=True, text=True).stdout
    rows = []
    for block in re.split(r"\n\s+Function : ", text)[1:]:
        lines = block.split("\n")
        name = re.sub(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_[A-Za-z0-9_]+?_[0-9a-f]{8}", "_GLOBAL__N_", lines[0].strip())
        code = [re.sub(r"/\*[0-9a-f]{4,}\*/|/\* 0x[0-9a-f]+ \*/", "", line).strip() for line in lines[1:]
                if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]  # instruction lines only (not the ELF's file names)
        rows.append(f"{hashlib.sha256(chr(10).join(code).encode()).hexdigest()[:16]} {len(code):6d} {name}")
    return sorted(rows, key=lambda row: (row.split()[2], row))


if __name__ == "__main__":
    print("\n".join(digests(sys.argv[1])))
