import os

# Triton reads TRITON_INTERPRET when it is imported (its own library functions are decorated
# then), and torch.compile's inductor imports it before epkit does in some test processes: so
# the test session decides first. Without a GPU, epkit's Triton kernels run interpreted.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI (the env var CI is set): derandomized examples, no per-example deadline.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")



def pytest_configure(config):
    """Under --dist loadgroup (pyproject.toml) each module marked xdist_group runs on one
    worker, which builds its costly module fixture (the wheel, the launch counts) once.
    pytest-xdist up to 3.8 tags a grouped test by rewriting ``item._nodeid``, which pytest 9 no
    longer reads: the groups are then silently spread over the workers and each rebuilds the
    fixture (minutes of CI). Refuse that pairing rather than run slowly."""
    option = config.option
    if (getattr(option, "dist", "no") != "loadgroup" or not getattr(option, "numprocesses", None)
            or not config.pluginmanager.has_plugin("xdist")):
        return
    import xdist

    def major_minor(v):
        return tuple(int(p) for p in v.split(".")[:2])

    if major_minor(pytest.__version__) >= (9, 0) and major_minor(xdist.__version__) <= (3, 8):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__}: xdist's "
            "--dist loadgroup does not group on this pytest (each worker would rebuild the costly "
            "module fixtures); install the pinned versions: pip install -e '.[test]'")
