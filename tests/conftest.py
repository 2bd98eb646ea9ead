import os

from hypothesis import settings

# CI (the env var CI is set): derandomized examples, no per-example deadline.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
