"""The engine's largest classes: methods per class, counting those inherited from the project's own classes.

    python scripts/class_sizes.py [--top N] [--max M]

With ``--max M`` it exits 1 when a class of ``lightning_swarm/swarm/`` has more than ``M`` methods.
"""

from __future__ import annotations

import argparse
import inspect
import pkgutil
import sys
from importlib import import_module

import lightning_swarm.swarm as engine


def _own_methods(cls: type) -> set[str]:
    """Names of the functions ``cls`` and its bases from ``lightning_swarm`` define (not object's or hivemind's)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("lightning_swarm."):
            continue
        names.update(
            n
            for n, v in vars(klass).items()
            if inspect.isfunction(v) or isinstance(v, staticmethod | classmethod | property)
        )
    return names


def engine_classes() -> dict[str, int]:
    """``{qualified class name: method count}`` for every class defined under ``lightning_swarm.swarm``."""
    counts = {}
    for info in pkgutil.walk_packages(engine.__path__, engine.__name__ + "."):
        module = import_module(info.name)
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and cls.__module__ == module.__name__:
                counts[f"{module.__name__}.{name}"] = len(_own_methods(cls))
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--max", type=int, default=None)
    args = parser.parse_args()
    counts = sorted(engine_classes().items(), key=lambda kv: -kv[1])
    for name, n in counts[: args.top]:
        print(f"{n:4d}  {name}")
    if args.max is not None and counts and counts[0][1] > args.max:
        print(f"{counts[0][0]} has {counts[0][1]} methods, more than {args.max}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
