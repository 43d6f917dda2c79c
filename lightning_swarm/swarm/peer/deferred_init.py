"""A model built on ``meta`` gets exactly the values its own code gives it: the build is recorded and replayed.

Under ``trainer.init_module()`` and in ``configure_model`` the :class:`~lightning_swarm.SwarmStrategy` builds the
model on the ``meta`` device. Whatever the model's code does to initialise its tensors - the layers'
``reset_parameters()`` in their constructors, a Hugging Face style ``self.apply(self._init_weights)`` after them,
``nn.Parameter(torch.randn(...))``, a buffer computed in ``__init__`` such as a causal mask, ``nn.init.orthogonal_``
with its temporaries - runs as ATen operations on ``meta`` tensors, which compute shapes only and draw no random
numbers. :class:`InitRecorder` (a ``TorchDispatchMode`` active during the build) records those operations in order.

:func:`replay` then runs the recorded operations again on real storage, from the random generators' state when the
build began, so that every tensor gets the value one process running the same code with the same seed gives it,
on every peer. Only the tensors of the modules a peer keeps (and the temporaries they are computed from) are
given storage: an operation that writes only tensors of modules the peer does not keep is skipped, or, if it draws
random numbers, run on a scratch tensor of the same shape that is freed at once, so that the generators advance
exactly as in one process. Temporaries are freed after their last use.

A tensor is identified by its storage (``untyped_storage()._cdata``), so views and ``.data`` aliases of a parameter
map to it; every meta tensor the build produced is kept alive (meta tensors hold no memory) so that no storage
address is reused while the recording lives.

An operation that computes a kept tensor from one the peer does not keep (``w2 = nn.Parameter(w1 * 2)`` across
stages) cannot be replayed without the other stage's values: :func:`replay` refuses it with one error naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["InitRecorder", "replay"]

# ATen operations that draw from a random generator: replayed on scratch memory when their result is not kept
_RANDOM_OPS = frozenset(
    {
        "normal",
        "normal_",
        "uniform",
        "uniform_",
        "bernoulli",
        "bernoulli_",
        "random_",
        "exponential_",
        "geometric_",
        "cauchy_",
        "log_normal_",
        "rand",
        "rand_like",
        "randn",
        "randn_like",
        "randint",
        "randint_like",
        "randperm",
        "multinomial",
        "native_dropout",
        "poisson",
        "binomial",
        "_standard_gamma",
        "_sample_dirichlet",
        "normal_functional",
    }
)


# torch.nn.init functions that return at once on meta (they skip the work there): recorded as calls, replayed
# by calling them on the real tensor; (module attribute, whether it draws random numbers)
_META_NOOP_INITS = (
    ("_no_grad_trunc_normal_", True),
    ("orthogonal_", True),
    ("sparse_", True),
    ("dirac_", False),
)


class _InitCall:
    """A recorded call of one of torch.nn.init's functions that do nothing on meta (see ``_META_NOOP_INITS``)."""

    def __init__(self, fn: Callable[..., Any], random: bool) -> None:
        self.fn, self.random = fn, random
        self.name = fn.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __str__(self) -> str:
        return f"torch.nn.init.{self.name}"


def _is_random(func: Any) -> bool:
    if isinstance(func, _InitCall):
        return func.random
    return func.overloadpacket.__name__ in _RANDOM_OPS


def _key(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def _metas(tree: Any) -> list[Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor) and t.is_meta]


class InitRecorder(TorchDispatchMode):
    """Records the ATen operations that read or produce ``meta`` tensors while it is active (see the module
    docstring). One recorder may be entered several times (``init_module`` then ``configure_model``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.keys: set[int] = set()  # storages the recorded operations produced

    def __enter__(self):
        import torch.nn.init as init

        self._patched = []
        for name, random in _META_NOOP_INITS:
            original = getattr(init, name, None)
            if original is None:
                continue
            self._patched.append((name, original))
            setattr(init, name, self._wrap(_InitCall(original, random)))
        return super().__enter__()

    def __exit__(self, *exc):
        import torch.nn.init as init

        try:
            return super().__exit__(*exc)
        finally:
            for name, original in self._patched:
                setattr(init, name, original)
            self._patched = []

    def _wrap(self, call: _InitCall) -> Callable[..., Any]:
        def recorded(tensor, *args, **kwargs):
            if isinstance(tensor, Tensor) and tensor.is_meta:
                self.ops.append((call, (tensor, *args), kwargs, tensor))
                return tensor
            return call.fn(tensor, *args, **kwargs)

        return recorded

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        produced = _metas(out)
        if produced or _metas((args, kwargs)):
            self.ops.append((func, args, kwargs, out))
            self.keys.update(_key(t) for t in produced)
        return out

    def covers(self, tensors: list[Tensor]) -> bool:
        """Whether every meta tensor of ``tensors`` was produced by a recorded operation."""
        return all(_key(t) in self.keys for t in tensors if t.is_meta)


def _written(func: Any, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensor arguments that ``func`` writes to (in-place and ``out=`` arguments), from its schema."""
    written: list[Tensor] = []
    if isinstance(func, _InitCall):  # they initialise their first argument
        return [args[0]]
    schema = getattr(func, "_schema", None)
    if schema is None:
        return written
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        written += [t for t in tree_flatten(value)[0] if isinstance(t, Tensor) and t.is_meta]
    return written


def replay(
    recorder: InitRecorder,
    root: nn.Module,
    keep: Callable[[nn.Module], bool],
    device: torch.device | str,
    rng: Any,
) -> tuple[int, int]:
    """Give the meta tensors of ``root``'s modules for which ``keep(module)`` holds storage on ``device`` and the
    values the recorded build computes for them; the others stay on meta. ``rng`` (a ``RngSnapshot``) is the
    generators' state when the build began. Returns ``(kept, skipped)``: how many modules holding meta tensors of
    their own were given storage, and how many were left on meta.

    Raises:
        ValueError: a kept tensor's initialisation reads a tensor of a module this peer does not keep.
    """
    device = torch.device(device)
    kept_keys: set[int] = set()
    dropped_keys: set[int] = set()
    modules = [(m, keep(m)) for m in root.modules()]
    counts = [0, 0]
    for module, kept in modules:
        own = [
            t
            for t in (*module._parameters.values(), *module._buffers.values())
            if t is not None and t.is_meta
        ]
        if own:
            counts[0 if kept else 1] += 1
        (kept_keys if kept else dropped_keys).update(_key(t) for t in own)
    dropped_keys -= kept_keys  # a tensor shared by a kept module (tied weights) is kept
    last_use: dict[int, int] = {}
    for i, (_, args, kwargs, out) in enumerate(recorder.ops):
        for t in _metas((args, kwargs, out)):
            last_use[_key(t)] = i
    real: dict[int, torch.UntypedStorage] = {}
    tainted = set(dropped_keys)  # storages whose values this peer never computes

    def to_real(t: Any) -> Any:
        if isinstance(t, torch.device) and t.type == "meta":
            return device
        if not isinstance(t, Tensor) or not t.is_meta:
            return t
        storage = real[_key(t)]
        return torch.empty(0, dtype=t.dtype, device=device).set_(
            storage, t.storage_offset(), t.size(), t.stride()
        )

    def scratch(t: Any) -> Any:
        if isinstance(t, torch.device) and t.type == "meta":
            return device
        if not isinstance(t, Tensor) or not t.is_meta:
            return t
        if _key(t) in real:
            return to_real(t)
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        if rng is not None:
            rng.restore()
        for i, (func, args, kwargs, out) in enumerate(recorder.ops):
            inputs = {_key(t) for t in _metas((args, kwargs))}
            produced = [t for t in _metas(out) if _key(t) not in inputs and _key(t) not in real]
            writes = {_key(t) for t in _written(func, args, kwargs)}
            reads_tainted = bool(inputs & tainted)
            if reads_tainted or (produced and all(_key(t) in dropped_keys for t in produced)):
                kept_writes = (writes - tainted) | {_key(t) for t in produced if _key(t) in kept_keys}
                if reads_tainted and kept_writes:
                    raise ValueError(
                        f"The model was built on meta and its initialisation computes a tensor this peer keeps from "
                        f"one of a stage it does not serve ({func}). Build that part outside the meta context, or "
                        "initialise each stage's tensors from its own."
                    )
                if _is_random(func):  # the generators advance as in one process
                    func(*tree_map(scratch, args), **tree_map(scratch, kwargs))
                tainted.update(_key(t) for t in produced)
            else:
                result = func(*tree_map(to_real, args), **tree_map(to_real, kwargs))
                metas_out, spec = tree_flatten(out)
                reals_out = tree_flatten(result)[0] if tree_flatten(result)[1] == spec else []
                for meta_t, real_t in zip(metas_out, reals_out, strict=False):
                    if isinstance(meta_t, Tensor) and meta_t.is_meta and _key(meta_t) not in real:
                        real[_key(meta_t)] = real_t.untyped_storage()
            for t in _metas((args, kwargs, out)):  # temporaries go after their last use
                k = _key(t)
                if last_use.get(k) == i and k not in kept_keys:
                    real.pop(k, None)
        after = type(rng).capture(device) if rng is not None else None
    if rng is not None and after is not None and rng.is_current():
        after.restore()  # as after one process's build: what draws next (dropout, shuffling) draws the same
    memo: dict[int, Tensor] = {}
    for module, kept in modules:
        if not kept:
            continue
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in memo:
                    memo[id(p)] = nn.Parameter(to_real(p), requires_grad=p.requires_grad)
                module._parameters[name] = cast(nn.Parameter, memo[id(p)])
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                if id(b) not in memo:
                    memo[id(b)] = to_real(b)
                module._buffers[name] = memo[id(b)]
    return counts[0], counts[1]
