"""The same-host sum: the peers of a stage that share a machine sum a step's gradients through shared memory, not
through hivemind's all-reduce.

A trainer-driven step names the stage's peers that sum their gradients (:class:`..stepping.StepCommand`'s
``group``). Over hivemind every peer copies its gradients into its averager process, which streams them in parts
through two p2p daemons to the others and back: on one box that costs a second or more per step for a stage of
a few tens of millions of parameters, and the daemons' and averagers' CPU besides. When every named peer serves
the stage on this machine (its same-host socket, :mod:`.same_host`, exists: same user, same network namespace),
they exchange the gradients as files in a private shared-memory directory instead:

1. each peer writes its gradients once (float64, the stage's tensors in order: a peer's sum of several backwards
   is float64 already, see ``server.shared``) and publishes one hard link per reader, ``sum-<round>-<from>-to-<to>``, then removes the name it wrote (a reader never sees a partial file);
2. each peer opens the links addressed to it, unlinks them (the data is freed once every reader has it), and
   sums every peer's values in the group's order, so that every peer holds the same bits; in float64, where the
   sum of float32 values is exact but for terms more than about 2**28 apart, so it also does not depend on which
   of the step's backwards each peer served (several trainers' calls reach the stage's peers at random): a
   run is reproducible, as DDP's is;
3. a peer that does not publish within the timeout fails the round (:class:`SameHostSumFailed`): the caller
   steps as after a failed hivemind round, and the links it left for others are removed.

The files live in ``/dev/shm`` (else, or when it lacks room, as in a container's default 64 MB, in
``$XDG_RUNTIME_DIR`` or the temp directory) ``/lightning-swarm-<uid>/net-<inode>/``: ``0700``, the same trust as
the same-host sockets. A private swarm's servers do not listen there, so their groups sum over hivemind's
authenticated P2P. Only a step's first attempt goes through here (see ``Stepper._sum_with_peers``): a redo goes
through hivemind, so that peers that cannot meet here (a full disk, a partner that cannot write) still sum.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.p2p import PeerID

from lightning_swarm.swarm.wire.same_host import private_directory, socket_path

__all__ = ["SameHostSumFailed", "on_one_host", "sum_on_host"]

_DTYPE, _BYTES = torch.float64, 8  # what a peer's gradients are exchanged and summed in
_POLL_S = 0.001  # how often a peer looks for a partner's gradients
_STALE_S = 600.0  # files older than this are a dead peer's leftovers (a round lasts seconds)
_SHM = "/dev/shm"


class SameHostSumFailed(Exception):
    """A same-host sum did not complete (a partner did not publish in time, or its gradients do not match)."""


def _directories() -> list[str]:
    """Where a peer may publish, best first: under ``/dev/shm`` (memory), else under the same-host sockets' base.
    Readers look in every one, so peers that chose differently (one found ``/dev/shm`` too full) still meet."""
    shm = _SHM if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK | os.X_OK) else None
    found = [private_directory(shm) if shm else None, private_directory()]
    return list(dict.fromkeys(d for d in found if d is not None))


def _with_room(directories: list[str], nbytes: int) -> str | None:
    for directory in directories:
        try:
            st = os.statvfs(directory)
        except OSError:
            continue
        if st.f_bavail * st.f_frsize >= 2 * nbytes:  # room for this peer's file and a partner's
            return directory
    return None


def on_one_host(peers: Sequence[bytes], uid: str) -> bool:
    """Whether every peer in ``peers`` (peer ids as bytes) serves stage ``uid`` on this machine and namespace: its
    same-host socket exists. Every member of a group computes the same answer, so they all take the same path."""
    if len(peers) < 2:
        return False
    for peer in peers:
        try:
            path = socket_path(PeerID(peer), uid)
        except Exception:
            return False
        if path is None or not os.path.exists(path):
            return False
    return True


def _tag(round_id: bytes) -> str:
    """The part of a round's file names that names the round."""
    return hashlib.sha256(round_id).hexdigest()[:32]


def _sweep(directory: str) -> None:
    now = time.time()
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith("sum-"):
                with contextlib.suppress(OSError):
                    if now - entry.stat(follow_symlinks=False).st_mtime > _STALE_S:
                        os.unlink(entry.path)


def _open_first(paths: list[str]) -> tuple[Any, str] | None:
    for path in paths:
        try:
            return open(path, "rb"), path  # noqa: SIM115 (the caller closes it)
        except FileNotFoundError:
            continue
    return None


def _read(paths: list[str], size: int, deadline: float) -> torch.Tensor | None:
    """The values at the first of ``paths`` to appear (unlinked once open), or ``None`` past ``deadline``."""
    while True:
        opened = _open_first(paths)
        if opened is None:
            if time.monotonic() > deadline:
                return None
            time.sleep(_POLL_S)
            continue
        f, path = opened
        with f:
            with contextlib.suppress(OSError):
                os.unlink(path)
            got = os.fstat(f.fileno()).st_size
            if got != _BYTES * size:
                raise SameHostSumFailed(
                    f"a partner's gradients have {got // _BYTES} values, this peer's {size}: the peers' stages differ"
                )
            values = torch.empty(size, dtype=_DTYPE)
            view, done = memoryview(values.numpy()).cast("B"), 0  # type: ignore[arg-type]
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise SameHostSumFailed(f"a partner's gradients ended after {done} of {len(view)} bytes")
                done += n
            return values


def sum_on_host(
    tensors: Sequence[torch.Tensor | None],
    templates: Sequence[torch.Tensor],
    round_id: bytes,
    peers: Sequence[bytes],
    me: bytes,
    timeout: float,
) -> list[torch.Tensor]:
    """The sum over ``peers`` (this peer is ``me``) of each peer's ``tensors`` (``None``: zeros shaped as the
    matching ``templates`` entry), exchanged through shared memory under ``round_id``; every peer gets the same
    bits. Raises :class:`SameHostSumFailed` if a partner's values do not arrive within ``timeout`` seconds."""
    directories = _directories()
    for d in directories:
        _sweep(d)
    index = list(peers).index(me)
    tag = _tag(round_id)
    with torch.no_grad():
        own = [
            (t if t is not None else torch.zeros_like(s)).detach().reshape(-1).to(_DTYPE).contiguous()
            for t, s in zip(tensors, templates, strict=True)
        ]
    size = sum(t.numel() for t in own)
    if not own:
        return []  # nothing to sum (every peer of the stage has the same tensors: none waits for this one)
    directory = _with_room(directories, _BYTES * size)
    if directory is None:
        raise SameHostSumFailed(f"no private directory with room for {_BYTES * size} bytes of gradients")
    written = os.path.join(directory, f"sum-{tag}-{index}.part")
    links = [os.path.join(directory, f"sum-{tag}-{index}-to-{j}") for j in range(len(peers)) if j != index]
    try:
        with open(written, "wb") as f:
            for t in own:
                f.write(memoryview(t.numpy()).cast("B"))  # type: ignore[arg-type]
        for link in links:
            os.link(written, link)
    except OSError as e:
        raise SameHostSumFailed(f"cannot publish this peer's gradients: {e!r}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(written)
    try:
        deadline = time.monotonic() + timeout
        parts: dict[int, torch.Tensor] = {}
        for j in range(len(peers)):
            if j != index:
                paths = [os.path.join(d, f"sum-{tag}-{j}-to-{index}") for d in directories]
                try:
                    values = _read(paths, size, deadline)
                except OSError as e:  # a file this peer cannot read: the round fails, the step goes on
                    raise SameHostSumFailed(f"cannot read peer {j}'s gradients: {e!r}") from None
                if values is None:
                    raise SameHostSumFailed(
                        f"peer {j} of the group did not publish its gradients in {timeout:.0f} s"
                    )
                parts[j] = values
    except BaseException:
        for link in links:  # nobody will read them now
            with contextlib.suppress(OSError):
                os.unlink(link)
        raise
    # the sum in the group's order on every peer, so that every peer holds the same bits (of two, either order:
    # float addition is commutative, so the partner's buffer takes this peer's values in place, with no copy)
    first = next(iter(parts)) if len(peers) == 2 else 0
    total = parts[first] if first in parts else torch.cat(own)
    for j in range(len(peers)):
        if j == first:
            continue
        if j in parts:
            total.add_(parts[j])
        else:
            offset = 0
            for t in own:
                total[offset : offset + t.numel()].add_(t)
                offset += t.numel()
    out, offset = [], 0
    for s in templates:
        out.append(total[offset : offset + s.numel()].view(s.shape).to(s.dtype))
        offset += s.numel()
    return out
