"""mlx-lm's own test files (upstream/, verbatim) run through adapter.py: collected only through the
test_on_*.py modules, each of which names the caches it runs them on (`SPEC`)."""
import sys

import pytest

from adapter import _MODEL as _MODELS
from adapter import patched_mlx_lm

collect_ignore = ["upstream"]


@pytest.fixture(autouse=True, scope="module")
def _library_caches(request):
    with patched_mlx_lm(getattr(request.module, "SPEC", None)):
        yield


@pytest.fixture(autouse=True)
def _model_as_found():
    """A test that sets `model.make_cache` removes it at its end; one that fails first would leave it on the
    model every test shares (adapter.local_model), and every later test would run on its caches."""
    yield
    for model, _ in _MODELS.values():
        vars(model).pop("make_cache", None)


@pytest.fixture(autouse=True)
def _report_differences(request):
    """Prints the largest difference each `mx.allclose` of the test saw (`pytest -s`), for README.md."""
    module = sys.modules.get(getattr(request.node, "cls", None).__module__) if getattr(request.node, "cls", None) else None
    tolerant = getattr(module, "mx", None)
    before = len(getattr(tolerant, "seen", ()))
    yield
    if hasattr(tolerant, "seen") and len(tolerant.seen) > before:
        worst = max(tolerant.seen[before:])
        print(f"\nallclose {request.node.nodeid}: max |a - b| {worst[0]:.3g} (max |b| {worst[1]:.3g})")
