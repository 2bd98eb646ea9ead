import os

# Triton reads TRITON_INTERPRET when it is imported (its own library functions are decorated
# then), and torch.compile's inductor imports it before epkit does in some test processes: so
# the test session decides first. Without a GPU, epkit's Triton kernels run interpreted.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

from hypothesis import settings  # noqa: E402

# CI (the env var CI is set): derandomized examples, no per-example deadline.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
