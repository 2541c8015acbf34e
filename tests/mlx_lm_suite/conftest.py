"""mlx-lm's own test files (upstream/, verbatim) run through adapter.py: collected only through the
test_on_*.py modules, each of which names the caches it runs them on (`SPEC`)."""
import pytest

from adapter import patched_mlx_lm

collect_ignore = ["upstream"]


@pytest.fixture(autouse=True, scope="module")
def _library_caches(request):
    with patched_mlx_lm(getattr(request.module, "SPEC", None)):
        yield
