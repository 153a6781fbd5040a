"""``lazy_face``: a package's public names imported on first use (PEP 562), so
``dataferry --help`` and a script that never touches a backend stay fast."""

from __future__ import annotations

import importlib
import sys

__all__ = ["lazy_face"]


def lazy_face(package: str, public: dict[str, str], shared: dict[str, str] | None = None):
    """``(__all__, __getattr__, __dir__)`` for ``package``: ``public`` and ``shared`` map a module
    (relative to the package) to the names it defines, space separated; ``__all__`` lists the
    public ones only. A name is imported from its module when first read, then kept."""
    where = {name: mod for mod, names in public.items() for name in names.split()}
    names = list(where)
    where |= {name: mod for mod, names in (shared or {}).items() for name in names.split()}

    def __getattr__(name: str):
        mod = where.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{mod}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(names)

    return names, __getattr__, __dir__
