"""megamoe.hf is megamoe.adapters.hf, the Hugging Face transformers integration, under the name it was first imported
by: `import megamoe.hf` registers experts_implementation="megamoe" as before. The very module object, not a copy of its
names, so that setting an attribute (a test's monkeypatch) on one is setting it on the other."""

import sys

from .adapters import hf

sys.modules[__name__] = hf
