"""epkit inside the frameworks people train with: each module is a thin token dispatcher over
epkit's public API (``epkit.Dispatcher``, ``epkit.topk_from_routing_map``) that a framework's own
MoE layer calls in place of its dispatcher.

- ``epkit.integrations.megatron``: ``TokenDispatcher``, a Megatron-Core ``MoETokenDispatcher``;
  ``install(moe_layer, **options)`` puts it into a ``MoELayer``.
- ``epkit.integrations.torchtitan``: ``TokenDispatcher``, a torchtitan ``BaseEPTokenDispatcher``;
  ``swap_token_dispatcher(routed_experts_config, **options)`` installs it through torchtitan's
  config, as torchtitan's own ``swap_token_dispatcher`` does.

Each imports only when its framework is installed (``pip install 'epkit[frameworks]'``), with an
ImportError that says so otherwise. docs/migrating.md maps one framework's terms onto epkit's.
"""

from __future__ import annotations

import importlib

__all__ = ["require"]


def require(module: str, package: str, what: str):
    """``module`` imported, or an ImportError naming the pip package ``what`` needs."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{what} needs {package} (not importable here: {exc}). Install it with "
            f"`pip install 'epkit[frameworks]'` (the pinned versions epkit is tested against) "
            f"or `pip install {package}`.") from exc
