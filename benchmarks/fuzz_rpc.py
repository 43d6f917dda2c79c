"""Fuzz a live stage server with hostile and malformed requests; then check that it still serves correctly.

A stage server (``Linear(64, 64)``, SGD, compression ``none``, request limit 64 MiB) runs in a child process, so
that a crash is counted rather than taking the benchmark down (a crashed server is restarted). A hostile client
built on hivemind's P2P directly (raw ``runtime_pb2`` messages, not the project's client) sends:

- the hostile cases: garbage bytes, truncated tensors, wrong dtype, wrong shape, a huge declared size, 8-bit
  parts declaring more than the limit once decoded, an endless stream, NaN and Inf inputs and output gradients,
  an unknown stage (over ``rpc_channel``, ``rpc_info`` and ``rpc_state``), a flood of 64 concurrent channels;
- ``--requests`` generated malformed requests (seeded): valid requests with one header field, payload
  metadata, tensor part field or buffer replaced, truncated, bit-flipped or poisoned with NaN/Inf, and pure
  garbage; 8 channels in parallel, a channel the server cuts is reopened.

The server runs with the bad-peer ban off (``BadPeers(limit=10**9)``), so that every request is parsed and
validated rather than refused at the door. Then another peer sends one well-formed forward and compares the reply
with the same module run locally. The child's resident memory is sampled throughout.

Usage: ``python benchmarks/fuzz_rpc.py [--quick]`` (``--quick``: 10,000 generated requests, otherwise 50,000).
The last stdout line is one JSON object (also written to ``runs/fuzz_rpc/fuzz_rpc.json``, ``--out``): ``cases`` (requests and hostile cases sent), ``server_crashes``,
``well_formed_after_ok``, ``max_rss_growth_mb``; for the generated requests ``error_replies``, ``cut_streams`` and
``accepted`` (mutations that stayed well-formed, e.g. another request id or a bit flip in a float); the outcomes of
the ``hostile_cases`` (``ok`` would be a failure), ``seconds`` and ``loadavg``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable

import _harness
import msgpack
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from torch import nn

from lightning_swarm.swarm.loop import run_coroutine
from lightning_swarm.swarm.wire.payload import Payload
from lightning_swarm.swarm.wire.protocol import StageRequest, StageService, parse_reply, stage_uid
from lightning_swarm.swarm.wire.transport import MessageReceiver, encode_request

RUN_ID, WIDTH, LIMIT = "fuzz", 64, 64 * 1024 * 1024
UID = stage_uid(RUN_ID, 0)
CHANNEL = StageService._get_handle_name(UID, "rpc_channel")


def module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(WIDTH, WIDTH)


def serve() -> None:
    """The child: one stage server until stdin closes; prints its peer id, multiaddrs and pid as JSON."""
    import hivemind

    from lightning_swarm.swarm.lifetime import die_with_parent
    from lightning_swarm.swarm.logs import quiet_routine_logs
    from lightning_swarm.swarm.server import StageServer
    from lightning_swarm.swarm.settings import SwarmSettings
    from lightning_swarm.swarm.wire.guards import BadPeers

    die_with_parent()
    quiet_routine_logs()
    torch.set_num_threads(1)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    settings = SwarmSettings(run_id=RUN_ID, num_stages=1, compression="none", target_batch_size=10**9)
    server = StageServer(
        0,
        module(),
        dht=dht,
        settings=settings,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=1e-3),
        throughput=1.0,
        max_request_bytes=LIMIT,
        bad_peers=BadPeers(limit=10**9),
    ).start()
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    print(json.dumps({"peer_id": str(server.peer_id), "maddrs": maddrs, "pid": os.getpid()}), flush=True)
    sys.stdin.read()
    server.shutdown()
    dht.shutdown()


class Server:
    def __init__(self) -> None:
        self.proc = _harness.popen(
            [sys.executable, __file__, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None if os.environ.get("FUZZ_VERBOSE") else subprocess.DEVNULL,
            text=True,
            cwd=_harness.ROOT,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the stage server process did not start (run with FUZZ_VERBOSE=1 to see why)")
        info = json.loads(line)
        self.peer_id = PeerID.from_base58(info["peer_id"])
        self.maddrs = info["maddrs"]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_mb(self) -> float:
        return _harness.memory.vm_rss_mb(self.proc.pid)

    def stop(self) -> None:
        if self.alive():
            _harness.stop_with_stdin(self.proc, timeout=30)


def message(inputs: Payload, grads: Payload | None = None, uid: str = UID, compression: str = "none"):
    request = StageRequest("forward" if grads is None else "backward", uid, inputs, grads, request_id=7)
    metadata, encoded = encode_request(request, compression)
    return runtime_pb2.ExpertRequest(tensors=[p for e in encoded for p in e.parts()], metadata=metadata)


def x(rows: int = 4, width: int = WIDTH, dtype: torch.dtype = torch.float32, grad: bool = False) -> Payload:
    return Payload.call((torch.randn(rows, width, dtype=dtype, requires_grad=grad),), {})


def hostile_cases() -> list[tuple[str, Iterable[runtime_pb2.ExpertRequest]]]:
    good = message(x())
    truncated = runtime_pb2.Tensor()
    truncated.CopyFrom(good.tensors[0])
    truncated.buffer = truncated.buffer[:5]
    huge = runtime_pb2.Tensor(buffer=b"\x00" * 64, size=[1 << 20, 1 << 20], dtype="float32", chunks=1 << 20)
    cases = [
        ("garbage", [runtime_pb2.ExpertRequest(tensors=[truncated], metadata=b"\xc1\x00garbage")]),
        ("garbage header", [runtime_pb2.ExpertRequest(metadata=os.urandom(64))]),
        ("truncated", [runtime_pb2.ExpertRequest(tensors=[truncated], metadata=good.metadata)]),
        ("wrong dtype", [message(x(dtype=torch.float64))]),
        ("wrong shape", [message(x(width=5))]),
        ("huge declared size", [runtime_pb2.ExpertRequest(tensors=[huge], metadata=good.metadata)]),
        ("8-bit bomb", [message(Payload.call((torch.randn(LIMIT // 4 + 4096),), {}), compression="8bit")]),
        ("endless stream", endless()),
        ("unknown stage", [message(x(), uid="other.stage3")]),
    ]
    for value in (math.nan, math.inf, -math.inf):
        poisoned = torch.randn(4, WIDTH)
        poisoned[2, 5] = value
        cases.append((f"{value} input", [message(Payload.call((poisoned,), {}))]))
        cases.append((f"{value} grad_outputs", [message(x(grad=True), Payload.flatten((poisoned,)))]))
    return cases


def endless() -> Iterable[runtime_pb2.ExpertRequest]:
    part = list(Payload.call((torch.randn(1024, 1024),), {}).encode("none").parts())
    for _ in range(10_000):  # 40 GB if the server kept it all
        yield runtime_pb2.ExpertRequest(tensors=part)


class Mutator:
    """Malformed requests from a seeded RNG: valid requests with something replaced, truncated or poisoned."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.templates = [
            message(x()),
            message(x(rows=1)),
            message(x(grad=True), Payload.flatten((torch.randn(4, WIDTH),))),
            message(
                Payload.call(
                    (torch.randn(2, WIDTH),), {"scale": 2.0, "mask": torch.ones(2, dtype=torch.bool)}
                )
            ),
            message(Payload.call((torch.randn(4096 // WIDTH * 4, WIDTH),), {}), compression="8bit"),
            message(Payload.call((torch.randn(64, WIDTH),), {}), compression="fp16"),
        ]

    def value(self, depth: int = 0):
        r = self.rng
        kind = r.randrange(9 if depth < 3 else 6)
        if kind == 0:
            return None
        if kind == 1:
            return r.choice([0, -1, 1, 2**62, -(2**63), 2**64 - 1, r.randrange(-1000, 1000)])
        if kind == 2:
            return r.choice([0.0, -1.5, 1e308, math.nan, math.inf])
        if kind == 3:
            return r.choice(["", "forward", "backward", UID, "T", "t", "d", "l", "x" * r.randrange(100)])
        if kind == 4:
            return os.urandom(r.randrange(32))
        if kind == 5:
            return r.choice([True, False])
        if kind == 6:
            return [r.choice(["T", "t", "l", "d"]), *(self.value(depth + 1) for _ in range(r.randrange(4)))]
        if kind == 7:
            return [self.value(depth + 1) for _ in range(r.randrange(5))]
        return {str(self.value(depth + 1))[:8]: self.value(depth + 1) for _ in range(r.randrange(3))}

    def part(self, template: runtime_pb2.Tensor) -> runtime_pb2.Tensor:
        r, part = self.rng, runtime_pb2.Tensor()
        part.CopyFrom(template)
        field = r.randrange(7)
        if field == 0:
            part.dtype = r.choice(["float32", "float64", "int64", "bool", "bfloat16", "float8", "", "uint8"])
        elif field == 1:
            del part.size[:]
            part.size.extend(
                r.choice([[], [0], [2**32 - 1] * r.randrange(1, 4), [r.randrange(9)] * r.randrange(6)])
            )
        elif field == 2:
            part.compression = r.choice([0, 1, 2, 3, 5, 0x4C38, 2**31 - 1])
        elif field == 3:
            part.chunks = r.choice([0, 2, 7, 2**31 - 1, -1, -(2**31)])
        elif field == 4:
            buffer = bytearray(part.buffer)
            for _ in range(r.randrange(1, 8)):
                if buffer:
                    buffer[r.randrange(len(buffer))] = r.randrange(256)
            part.buffer = bytes(buffer[: r.randrange(len(buffer) + 1)] if r.random() < 0.5 else buffer)
        elif field == 5:
            part.buffer = part.buffer + os.urandom(r.randrange(1, 64))
        else:
            part.buffer = os.urandom(r.randrange(256))
        return part

    def request(self) -> runtime_pb2.ExpertRequest:
        r = self.rng
        template = r.choice(self.templates)
        tensors, header = list(template.tensors), template.metadata
        kind = r.randrange(8)
        if kind == 0:  # pure garbage
            return runtime_pb2.ExpertRequest(metadata=os.urandom(r.randrange(1, 200)), tensors=tensors[:1])
        if kind in (1, 2):  # one header field (or a payload's metadata) replaced
            fields = msgpack.unpackb(header)
            i = r.randrange(len(fields))
            if isinstance(fields[i], bytes) and kind == 2:
                fields[i] = msgpack.packb(
                    [self.value(), r.choice([0, 1, 2, 3, -1, 2**40])], use_bin_type=True
                )
            else:
                fields[i] = self.value()
            header = msgpack.packb(fields, use_bin_type=True)
        elif kind == 3:  # bit flips in the header
            raw = bytearray(header)
            for _ in range(r.randrange(1, 4)):
                raw[r.randrange(len(raw))] ^= 1 << r.randrange(8)
            header = bytes(raw)
        elif kind == 4:  # a tensor part field replaced
            i = r.randrange(len(tensors))
            tensors[i] = self.part(tensors[i])
        elif kind == 5:  # tensors dropped, duplicated or reordered
            tensors = r.choice([tensors[:-1], tensors + tensors[:1], tensors[::-1], []])
        elif kind == 6:  # NaN / Inf values
            values = torch.randn(4, WIDTH)
            values.view(-1)[r.randrange(values.numel())] = r.choice([math.nan, math.inf, -math.inf])
            grads = Payload.flatten((values,)) if r.random() < 0.5 else None
            inputs = Payload.call(
                (values if grads is None else torch.randn(4, WIDTH, requires_grad=True),), {}
            )
            return message(inputs, grads)
        else:  # a plausible tensor of another shape or dtype
            dtype = r.choice([torch.float64, torch.float16, torch.int64, torch.bfloat16, torch.float32])
            shape = r.choice([(4, WIDTH + 1), (WIDTH,), (2, 2, WIDTH), (), (0, WIDTH)])
            return message(Payload.call((torch.zeros(shape, dtype=dtype),), {}))
        return runtime_pb2.ExpertRequest(tensors=tensors, metadata=header)


class Channel:
    """A raw rpc_channel stream to the server: send a call's messages, read its reply."""

    def __init__(self, p2p: P2P, peer_id: PeerID) -> None:
        self.p2p, self.peer_id = p2p, peer_id
        self.outbox: asyncio.Queue | None = None
        self.replies: AsyncIterator | None = None

    async def call(self, messages: Iterable[runtime_pb2.ExpertRequest], timeout: float = 60.0):
        """``("error", reply)``, ``("ok", reply)`` or ``("cut", None)`` (the server ended the stream)."""
        if self.replies is None:
            outbox = self.outbox = asyncio.Queue()

            async def outgoing() -> AsyncIterator[runtime_pb2.ExpertRequest]:
                while (item := await outbox.get()) is not None:
                    yield item

            self.replies = await self.p2p.iterate_protobuf_handler(
                self.peer_id, CHANNEL, outgoing(), runtime_pb2.ExpertResponse
            )
        try:
            return await asyncio.wait_for(self._call(messages), timeout)
        except Exception:
            await self.close()
            return "cut", None

    async def _call(self, messages: Iterable[runtime_pb2.ExpertRequest]):
        sender = asyncio.ensure_future(self._send(messages))
        receiver = MessageReceiver()
        try:
            async for reply in self.replies:
                if receiver.feed(reply):
                    parsed = parse_reply(*receiver.result())
                    return ("error" if parsed.error is not None else "ok"), parsed
        finally:
            sender.cancel()
        await self.close()
        return "cut", None

    async def _send(self, messages: Iterable[runtime_pb2.ExpertRequest]) -> None:
        for item in messages:
            while self.outbox is not None and self.outbox.qsize() > 4:
                await asyncio.sleep(0.001)
            if self.outbox is None:
                return
            self.outbox.put_nowait(item)
            await asyncio.sleep(0)

    async def close(self) -> None:
        if self.outbox is not None:
            self.outbox.put_nowait(None)
        if self.replies is not None:
            try:
                await self.replies.aclose()
            except Exception:
                pass
        self.outbox = self.replies = None


async def unknown_stage_other_rpcs(p2p: P2P, peer_id: PeerID) -> int:
    """rpc_info and rpc_state for a stage the server does not serve: both must refuse; returns refusals."""
    wrong = runtime_pb2.ExpertUID(uid="other.stage3")
    refused = 0
    try:
        await p2p.call_protobuf_handler(
            peer_id, StageService._get_handle_name(UID, "rpc_info"), wrong, runtime_pb2.ExpertInfo
        )
    except Exception:
        refused += 1
    stream = await p2p.iterate_protobuf_handler(
        peer_id, StageService._get_handle_name(UID, "rpc_state"), wrong, runtime_pb2.ExpertResponse
    )
    if not any(m.metadata for m in [m async for m in stream]):
        refused += 1
    return refused


def main() -> None:
    parser = _harness.parser(
        "fuzz_rpc", __doc__.split("\n")[0], quick="10,000 generated requests (default 50,000)"
    )
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    report = _harness.Report("fuzz_rpc", args.out)
    from lightning_swarm.swarm.logs import quiet_routine_logs

    quiet_routine_logs()
    torch.set_num_threads(1)
    total = args.requests or (10_000 if args.quick else 50_000)
    start = time.monotonic()
    server = Server()
    crashes, outcomes, hostile_outcomes, rss = 0, Counter(), Counter(), []

    async def create(maddrs: list[str]) -> P2P:
        return await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    hostile = run_coroutine(create(server.maddrs), timeout=60)
    honest = run_coroutine(create(server.maddrs), timeout=60)
    reference = module()

    def well_formed() -> bool:
        inputs = torch.randn(4, WIDTH)

        async def call():
            channel = Channel(honest, server.peer_id)
            try:
                return await channel.call([message(Payload.call((inputs,), {}))])
            finally:
                await channel.close()

        status, reply = run_coroutine(call(), timeout=90)
        if status != "ok" or reply.request_id != 7:
            return False
        with torch.no_grad():
            return torch.allclose(reply.outputs.rebuild(), reference(inputs), atol=1e-5, rtol=0)

    def check_alive() -> None:
        nonlocal server, crashes, hostile
        if not server.alive():
            crashes += 1
            server = Server()  # the hostile client goes on against a fresh server
            for p2p in (hostile,):
                run_coroutine(p2p.shutdown(), timeout=30)
            hostile = run_coroutine(create(server.maddrs), timeout=60)

    assert well_formed(), "the server did not answer a well-formed request before the fuzzing"
    rss_start = server.rss_mb()
    cases = 0

    async def run_cases() -> None:
        nonlocal cases
        for _name, messages in hostile_cases():
            channel = Channel(hostile, server.peer_id)
            status, _ = await channel.call(messages)
            hostile_outcomes[status] += 1
            cases += 1
            await channel.close()
        hostile_outcomes["refused_other_rpcs"] += await unknown_stage_other_rpcs(hostile, server.peer_id)
        cases += 2
        flood_message = hostile_cases()[4][1]

        async def flood_one() -> str:
            channel = Channel(hostile, server.peer_id)
            try:
                return (await channel.call(flood_message * 1))[0]
            finally:
                await channel.close()

        for status in await asyncio.gather(*(flood_one() for _ in range(64))):
            hostile_outcomes[status] += 1
            cases += 1

    run_coroutine(run_cases(), timeout=600)
    check_alive()
    rss.append(server.rss_mb())

    mutator = Mutator(args.seed)
    sent = 0
    batch = 1000
    while sent < total:
        n = min(batch, total - sent)
        requests = [mutator.request() for _ in range(n)]

        async def worker(chunk: list) -> None:
            channel = Channel(hostile, server.peer_id)
            for request in chunk:
                status, _ = await channel.call([request], timeout=30)
                outcomes[status] += 1
            await channel.close()

        async def fuzz_batch(requests: list) -> None:
            await asyncio.gather(*(worker(requests[i::8]) for i in range(8)))

        run_coroutine(fuzz_batch(requests), timeout=900)
        sent += n
        cases += n
        check_alive()
        rss.append(server.rss_mb())
        print(f"{sent}/{total} requests, {dict(outcomes)}, server RSS {rss[-1]:.0f} MB", file=sys.stderr)

    ok = server.alive() and well_formed()
    rss.append(server.rss_mb())
    for p2p in (hostile, honest):
        run_coroutine(p2p.shutdown(), timeout=30)
    server.stop()
    result = {
        "cases": cases,
        "generated_requests": total,
        "server_crashes": crashes,
        "well_formed_after_ok": bool(ok),
        "max_rss_growth_mb": round(max(rss) - rss_start, 1),
        "server_rss_start_mb": round(rss_start, 1),
        "error_replies": outcomes["error"],
        "cut_streams": outcomes["cut"],
        "accepted": outcomes["ok"],
        "hostile_cases": dict(hostile_outcomes),
        "seconds": round(time.monotonic() - start, 1),
        "loadavg": [round(v, 2) for v in os.getloadavg()],
    }
    report.finish(result)


if __name__ == "__main__":
    main()
