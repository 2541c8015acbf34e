"""Method names to method classes. `methods/` fills it (`register_method`) when the package is
imported; the config reads it to validate a method's name and options."""

from __future__ import annotations

from typing import Callable, Dict

_REGISTRY: Dict[str, type] = {}


def register_method(name: str) -> Callable[[type], type]:
    def register(cls):
        if name in _REGISTRY:
            raise ValueError(f"method {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return register


def get_method(name: str) -> type:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown KV cache method {name!r}; known methods: {known}") from None


def available_methods() -> Dict[str, type]:
    return dict(sorted(_REGISTRY.items()))
