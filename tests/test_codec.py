"""Boundary codec: round trips, compression ratios, error bounds, call signatures, malformed input."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hivemind.proto import runtime_pb2

from lightning_swarm.swarm.wire import quantize
from lightning_swarm.swarm.wire.codec import (
    COMPRESSIONS,
    CodecError,
    all_finite,
    decode_parts,
    decode_tensor,
    encode_tensor,
    nbytes,
)
from lightning_swarm.swarm.wire.payload import Payload
from lightning_swarm.swarm.wire.quantize import bnb as quantize_bnb
from lightning_swarm.swarm.wire.quantize import fast as quantize_fast
from lightning_swarm.swarm.wire.quantize import threads as quantize_threads

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
OTHER_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64]


def pack(args: tuple, kwargs: dict, compression: str) -> tuple[list[runtime_pb2.Tensor], bytes]:
    encoded = Payload.call(args, kwargs).encode(compression)
    return list(encoded.parts()), encoded.metadata


def unpack(tensors: list[runtime_pb2.Tensor], metadata: bytes) -> tuple[tuple, dict]:
    return Payload.from_wire(metadata, decode_parts(tensors)).rebuild_call()


def _rel_err(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.double() - exact.double()).norm() / exact.double().norm()).item()


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_float_round_trip(compression: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(33, 97, 5).to(dtype)  # not a multiple of the block size
    y = decode_tensor(encode_tensor(x, compression))
    assert y.dtype == dtype and y.shape == x.shape
    bound = {"none": 0.0, "fp16": 1e-3, "8bit": 0.02}[compression]
    if dtype == torch.float16 or dtype == torch.bfloat16:
        bound = max(bound, 0.0) if compression != "8bit" else 0.025
    assert _rel_err(y, x) <= bound
    if compression == "none":
        assert torch.equal(y, x)


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("dtype", OTHER_DTYPES)
def test_non_float_lossless(compression: str, dtype: torch.dtype) -> None:
    x = (torch.arange(-1000, 2000) % 7).to(dtype)
    if dtype == torch.complex64:
        x = torch.randn(3000, dtype=dtype)
    y = decode_tensor(encode_tensor(x.view(30, 100), compression))
    assert y.dtype == dtype and torch.equal(y, x.view(30, 100))


def test_scalar_empty_noncontiguous_and_tiny() -> None:
    for x in (torch.tensor(3.5), torch.empty(0, 4), torch.randn(64, 32).t(), torch.randn(10)):
        for compression in COMPRESSIONS:
            y = decode_tensor(encode_tensor(x, compression))
            assert y.shape == x.shape
            if x.numel() < 1024:  # tiny tensors travel losslessly
                assert torch.equal(y, x)
    # the decoded tensor is usable in place (the buffer is ours)
    y = decode_tensor(encode_tensor(torch.ones(3), "none"))
    y.add_(1)
    assert torch.equal(y, torch.full((3,), 2.0))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.int64]
)
def test_all_finite_finds_any_nan_or_infinity(dtype: torch.dtype) -> None:
    # all_finite is the one-pass check every stage call's tensors go through (protocol.check_finite)
    base = torch.randn(3000, dtype=torch.float64).mul(100).to(dtype)
    assert all_finite(base) and all_finite(base[:0]) and all_finite(base.reshape(30, 100).t())
    if not (dtype.is_floating_point or dtype.is_complex):
        return
    for bad in (float("nan"), float("inf"), float("-inf")):
        for pos in (0, 1, 7, 8, 15, 16, 17, 1023, 2999):  # every lane of a vectorised pass, both ends
            t = base.clone()
            t[pos] = bad
            assert not all_finite(t), (bad, pos)
            assert not all_finite(t.reshape(30, 100).t()), (bad, pos)  # non-contiguous


def test_8bit_size_and_error_bounds() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 4096)  # 1 MiB of fp32
    msg = encode_tensor(x, "8bit")
    assert nbytes([msg]) <= 0.27 * x.numel() * 4
    assert nbytes([encode_tensor(x, "fp16")]) <= 0.51 * x.numel() * 4
    assert nbytes([encode_tensor(x, "none")]) >= x.numel() * 4
    err = _rel_err(decode_tensor(msg), x)
    assert err < 0.015, err  # measured ~0.012 with blocksize 1024

    # 1% of entries scaled x100: blockwise absmax keeps the error local to the blocks with outliers
    outliers = torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) < 0.01
    xo = torch.where(outliers, x * 100, x)
    yo = decode_tensor(encode_tensor(xo, "8bit"))
    assert _rel_err(yo, xo) < 0.015, _rel_err(yo, xo)  # measured ~0.009 (dominated by the outliers)
    assert _rel_err(yo[~outliers], xo[~outliers]) < 0.06  # the normal entries, measured ~0.043


def test_requires_grad_flag_and_device_handling() -> None:
    x = torch.randn(2048, requires_grad=True)
    msg = encode_tensor(x, "8bit")
    assert msg.requires_grad
    args, _ = unpack(*pack((x, torch.arange(3)), {}, "none"))
    assert args[0].requires_grad and args[0].is_leaf and not args[1].requires_grad
    assert torch.equal(args[0].detach(), x.detach())


def test_pack_nested_structures() -> None:
    torch.manual_seed(0)
    h = torch.randn(4, 300)
    mask = torch.rand(4, 300) > 0.5
    args = (h, None, 3, 2.5, True, "causal", b"raw", [h, (mask, {"deep": [1, None]})])
    kwargs = {"attention_mask": mask, "cache": {"k": torch.arange(5), 7: "seven"}, "empty": (), "lst": []}
    tensors, metadata = pack(args, kwargs, "none")
    assert len(tensors) == 5 and isinstance(metadata, bytes)
    out_args, out_kwargs = unpack(tensors, metadata)
    assert isinstance(out_args, tuple) and len(out_args) == len(args)
    assert torch.equal(out_args[0], h) and out_args[1] is None and out_args[2] == 3 and out_args[3] == 2.5
    assert out_args[4] is True and out_args[5] == "causal" and out_args[6] == b"raw"
    assert isinstance(out_args[7], list) and isinstance(out_args[7][1], tuple)
    assert torch.equal(out_args[7][1][0], mask) and out_args[7][1][1] == {"deep": [1, None]}
    assert torch.equal(out_kwargs["cache"]["k"], torch.arange(5)) and out_kwargs["cache"][7] == "seven"
    assert out_kwargs["empty"] == () and out_kwargs["lst"] == []


def test_pack_rejects_unsupported_objects() -> None:
    with pytest.raises(CodecError, match="Cannot send a object"):
        pack((object(),), {}, "8bit")
    with pytest.raises(ValueError, match="Unknown boundary compression"):
        pack((), {}, "4bit")


def test_malformed_tensors_raise_codec_error() -> None:
    x = torch.randn(64, 64)
    good = {c: encode_tensor(x, c) for c in COMPRESSIONS}
    cases = []
    for msg in good.values():
        truncated = runtime_pb2.Tensor()
        truncated.CopyFrom(msg)
        truncated.buffer = msg.buffer[:-7]
        cases.append(truncated)
        wrong_shape = runtime_pb2.Tensor()
        wrong_shape.CopyFrom(msg)
        wrong_shape.size[:] = [64, 65]
        cases.append(wrong_shape)
    bad_block = runtime_pb2.Tensor()
    bad_block.CopyFrom(good["8bit"])
    bad_block.buffer = (12345).to_bytes(4, "little") + good["8bit"].buffer[4:]
    cases.append(bad_block)
    cases.append(runtime_pb2.Tensor(buffer=b"", size=[10], dtype="float32", compression=5))
    cases.append(runtime_pb2.Tensor(buffer=b"\0" * 40, size=[10], dtype="float128"))
    cases.append(runtime_pb2.Tensor(buffer=b"\0" * 40, size=[10], dtype="int32", compression=5))
    cases.append(runtime_pb2.Tensor(buffer=b"\0" * 40, size=[10], dtype="float32", compression=3))
    cases.append(runtime_pb2.Tensor(buffer=b"\0" * 40, size=[2**31, 2**31, 2**31], dtype="float32"))
    for msg in cases:
        with pytest.raises(CodecError):
            decode_tensor(msg)


def test_malformed_metadata_raises_codec_error() -> None:
    tensors, metadata = pack((torch.randn(3),), {"a": 1}, "none")
    garbage = [
        b"",
        b"\xc1\xc1\xc1",
        metadata[:-2],
        msgpack.packb([["t", ["t", ["T", 5]], ["d"]], 1]),  # tensor index out of range
        msgpack.packb([["t", ["t"], ["d"]], 2]),  # tensor count mismatch
        msgpack.packb([["t", ["l"], ["d"]], 1]),  # args not a tuple
        msgpack.packb([["t", ["t"], ["d", 1, 2]], 1]),  # non-string kwarg
        msgpack.packb([["t", ["t"], ["d", ["l"], 2]], 1]),  # unhashable key
        msgpack.packb([["t", ["?", 1], ["d"]], 1]),  # unknown tag
        msgpack.packb([["t", ["t", {"a": 1}], ["d"]], 1]),  # raw map where a node is expected
        msgpack.packb([["t", ["t"]], 1]),  # not (args, kwargs)
        msgpack.packb({"x": 1}),
        msgpack.packb([["t", ["t", ["T"]], ["d"]], 1]),  # tensor reference without index
        msgpack.packb(_deep(200)),
    ]
    for metadata_bytes in garbage:
        with pytest.raises(CodecError):
            unpack(tensors, metadata_bytes)


def _deep(depth: int) -> list:
    node: list = ["l"]
    for _ in range(depth):
        node = ["l", node]
    return [["t", ["t", node], ["d"]], 1]


def test_parts_decode_like_one_message_and_stream_one_by_one() -> None:
    from lightning_swarm.swarm.wire import codec

    g = torch.Generator().manual_seed(3)
    for shape in [(64, 4096), (3 * codec.PART_ELEMENTS + 5,), (7, codec.PART_ELEMENTS // 7 + 1)]:
        x = torch.randn(*shape, generator=g)
        for compression in COMPRESSIONS:
            parts = list(codec.encode_parts(x, compression))
            assert len(parts) == codec.num_parts(x.numel()) > 1
            assert parts[0].chunks == len(parts) and all(p.chunks == 0 for p in parts[1:])
            whole = decode_tensor(encode_tensor(x, compression))
            decoder = codec.PartsDecoder()
            for part in parts:
                assert decoder.tensors == []
                decoder.feed(part)
            (y,) = decoder.finish()
            # blocks never straddle parts, so the parts hold exactly the codes of the one-message encoding
            assert torch.equal(y, whole) and y.shape == x.shape
            sent = codec.nbytes(parts)
            assert sent <= codec.nbytes([encode_tensor(x, compression)]) + 64 * len(parts)
            with pytest.raises(CodecError, match="parts missing"):
                codec.decode_parts(parts[:-1])
            if compression != "none":
                mixed = runtime_pb2.Tensor()
                mixed.CopyFrom(parts[1])
                mixed.compression = 0
                with pytest.raises(CodecError):
                    codec.decode_parts([parts[0], mixed, *parts[2:]])
    impossible = encode_tensor(torch.randn(2048), "none")
    impossible.chunks = 3  # 2048 elements are two blocks: three parts cannot exist
    with pytest.raises(CodecError, match="impossible"):
        decode_tensor(impossible)


@pytest.mark.parametrize("helpers", [0, 1])
def test_8bit_buffers_are_bitsandbytes_own_output(helpers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shares quantized by several threads straight into the wire buffer equal one bitsandbytes call."""
    import threading

    import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)

    monkeypatch.setenv(quantize.HELPERS_ENV, str(helpers))
    threads_before = torch.get_num_threads()
    g = torch.Generator().manual_seed(5)
    for numel in (1500, quantize_threads._SHARE_ELEMENTS * 3 + 17, 262144):
        x = torch.randn(numel, generator=g) * 3
        with quantize.one_thread():
            codes, absmax = torch.ops.bitsandbytes.quantize_blockwise.default(
                x, quantize.dynamic_code(), quantize.BLOCKSIZE
            )
            expected = torch.ops.bitsandbytes.dequantize_blockwise.default(
                codes, absmax, quantize.dynamic_code(), quantize.BLOCKSIZE, torch.float32
            )
        buffer = quantize.quantize_to_buffer(x)
        header = quantize.BLOCKSIZE.to_bytes(4, "little")
        assert buffer == header + absmax.numpy().tobytes() + codes.numpy().tobytes()
        assert torch.equal(
            quantize.dequantize_buffer(buffer, quantize.BLOCKSIZE, numel, torch.float32), expected
        )
    # the codec's one-thread setting is per thread: it leaks neither to this thread nor to new threads
    assert torch.get_num_threads() == threads_before
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert seen == [threads_before]


def test_block_holding_the_most_negative_value_decodes_exactly() -> None:
    # bitsandbytes maps the block's absmax to code 0 (-1.0) when it is negative; every peer must decode it alike
    x = torch.full((4096,), 0.5)
    x[::1024] = -3.0
    y = decode_tensor(encode_tensor(x, "8bit"))
    assert torch.equal(y[::1024], x[::1024])


def test_received_tensor_is_resent_without_requantizing() -> None:

    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(4))
    for compression in ("8bit", "fp16"):
        msg = encode_tensor(x, compression)
        y = decode_tensor(msg)
        calls = quantize.quantizations.calls
        again = encode_tensor(y, compression)
        assert again.buffer == msg.buffer and quantize.quantizations.calls == calls  # no new quantization
        y.requires_grad_(True)
        assert encode_tensor(y, compression).requires_grad
        other = encode_tensor(y, "none")  # another compression: encoded afresh
        assert torch.equal(decode_tensor(other), y.detach())
        y.requires_grad_(False)
        y.mul_(2)  # modified in place: must be encoded afresh
        assert torch.allclose(decode_tensor(encode_tensor(y, compression)), y, atol=0.1)


def test_8bit_parts_carry_their_own_wire_tag() -> None:
    """Our 8-bit layout is not hivemind's BLOCKWISE_8BIT: a message tagged with hivemind's value is refused."""
    from lightning_swarm.swarm.wire.codec import WIRE_8BIT

    msg = encode_tensor(torch.randn(4096), "8bit")
    assert msg.compression == WIRE_8BIT != runtime_pb2.CompressionType.BLOCKWISE_8BIT
    assert WIRE_8BIT not in runtime_pb2.CompressionType.values()
    msg.compression = runtime_pb2.CompressionType.BLOCKWISE_8BIT
    with pytest.raises(CodecError, match="unsupported compression"):
        decode_tensor(msg)


def test_any_byte_string_decodes_or_raises_codec_error() -> None:
    """Whatever a peer sends, decoding returns tensors or raises CodecError, never another exception."""
    import random

    huge = runtime_pb2.Tensor(dtype="float32", size=[0, 2**32 - 1, 2**32 - 1])  # numel 0, strides overflow
    with pytest.raises(CodecError, match="impossible shape"):
        decode_tensor(huge)
    rng = random.Random(0)
    seeds = [encode_tensor(torch.randn(3000), c).SerializeToString() for c in COMPRESSIONS] + [
        encode_tensor(torch.arange(50), "none").SerializeToString(),
        huge.SerializeToString(),
    ]
    outcomes = {"decoded": 0, "CodecError": 0, "unparsable": 0}
    for i in range(3000):
        if i % 3 == 0:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64)))
        else:  # a valid message with a few bytes changed, cut or appended
            data = bytearray(rng.choice(seeds))
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.getrandbits(8)
            data = bytes(data[: rng.randrange(1, len(data) + 1)] if i % 3 == 1 else data)
        try:
            msg = runtime_pb2.Tensor.FromString(data)
        except Exception:  # protobuf's own parser refuses it: it never reaches the codec
            outcomes["unparsable"] += 1
            continue
        try:
            decode_tensor(msg)
            outcomes["decoded"] += 1
        except CodecError:
            outcomes["CodecError"] += 1
    assert outcomes["CodecError"] > 50 and outcomes["decoded"] > 50, outcomes


def test_importing_the_engine_has_no_side_effects() -> None:
    """No warning filters, no environment errors at import: a bad setting is reported when first used."""
    import subprocess
    import sys

    code = (
        "import warnings, torch, hivemind, bitsandbytes, lightning.pytorch  # these may set their own filters\n"
        "before = list(warnings.filters)\n"
        "import lightning_swarm.swarm, lightning_swarm.swarm.wire.codec, lightning_swarm.swarm.wire.quantize as q\n"
        "assert warnings.filters == before, 'import changed the warning filters'\n"
        "import torch\n"
        "from lightning_swarm.swarm.wire.codec import encode_tensor\n"
        "try:\n"
        "    encode_tensor(torch.randn(100000), '8bit')\n"
        "except ValueError as e:\n"
        "    print('first use:', e)\n"
    )
    env = {**__import__("os").environ, quantize.HELPERS_ENV: "many"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "first use: LIGHTNING_SWARM_CODEC_HELPERS must be a non-negative integer" in proc.stdout


def test_first_use_of_the_codec_prints_nothing_from_bitsandbytes() -> None:
    """bitsandbytes 0.50, imported on a CPU with AVX512-BF16, warns that its optional ``kernels`` package (a 4-bit
    kernel fetched from the Hugging Face hub) is missing: not this project's concern, so the codec's first use
    lowers that one notice to DEBUG. The process prints nothing."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from lightning_swarm.swarm.wire.codec import decode_tensor, encode_tensor\n"
        "x = torch.randn(100000)\n"
        "assert (decode_tensor(encode_tensor(x, '8bit')) - x).abs().max() < 0.1\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "" and proc.stdout == "", proc.stderr[-3000:]


def _edge_tensor() -> torch.Tensor:
    """Values where a table-driven quantizer could go wrong: every block kind bitsandbytes treats specially."""
    g = torch.Generator().manual_seed(11)
    block = quantize.BLOCKSIZE
    pieces = [
        torch.randn(block, generator=g) * 10 ** torch.randint(-38, 38, (1,), generator=g).item(),
        torch.zeros(block),  # 0/0: NaN after normalising
        -torch.zeros(block),
        torch.full((block,), -2.5),  # every value is the (negative) absmax
        torch.full((block,), 2.5),
        # tiny normalised values, where bitsandbytes' search is erratic
        torch.randn(block, generator=g) * 1e-8,
        torch.cat([torch.tensor([1.0]), torch.randn(block - 1, generator=g) * 3e-8]),
        torch.cat([torch.tensor([float("nan")]), torch.randn(block - 1, generator=g)]),
        torch.cat([torch.tensor([float("inf"), float("-inf")]), torch.randn(block - 2, generator=g)]),
        torch.full((block,), 1e-45),  # denormals
        torch.randn(block, generator=g) * 3.0e38,
        torch.randn(333, generator=g),  # a partial last block
    ]
    return torch.cat(pieces)


@pytest.mark.parametrize("helpers", [0, 1])
def test_fast_8bit_kernel_gives_bitsandbytes_bytes_on_edge_values(
    helpers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import shutil

    import bitsandbytes.functional as bnb_functional

    monkeypatch.setenv(quantize.HELPERS_ENV, str(helpers))
    if (shutil.which("cc") or shutil.which("gcc")) and os.environ.get(quantize.NATIVE_ENV, "1") != "0":
        # a compiler is here and the kernel is not turned off: it must have built and passed its self-check
        assert quantize.using_fast_kernel()
    x = _edge_tensor()
    expected_codes, state = bnb_functional.quantize_blockwise(
        x, code=quantize.dynamic_code().clone(), blocksize=quantize.BLOCKSIZE
    )
    buffer = quantize.quantize_to_buffer(x)
    header = quantize.BLOCKSIZE.to_bytes(4, "little")
    assert buffer == header + state.absmax.numpy().tobytes() + expected_codes.numpy().tobytes()
    expected = bnb_functional.dequantize_blockwise(expected_codes, state)
    decoded = quantize.dequantize_buffer(buffer, quantize.BLOCKSIZE, x.numel(), torch.float32)
    assert decoded.view(torch.int32).equal(expected.view(torch.int32))  # bitwise, NaN included


def test_fast_8bit_kernel_matches_bitsandbytes_around_every_threshold() -> None:
    """Each table threshold and each bucket edge, and the floats two steps either side of them, get bitsandbytes'
    own code (``benchmarks/quantizer_exhaustive.py`` checks every float in [-1, 1])."""
    fast = quantize_fast.fast_kernel()
    if fast is None:
        pytest.skip("no C compiler: the codec runs bitsandbytes' kernels themselves")
    kernel, _ = quantize_bnb.native_kernels()
    threshold = fast.thresholds[torch.isfinite(fast.thresholds)]
    assert (
        threshold.numel() >= 200
    )  # most of the 255 code changes fall inside a bucket; the others on an edge
    edges = quantize_fast._floats(
        torch.arange(1 << 16, dtype=torch.int64) << 16
    )  # first float of every bucket
    edges = edges[edges.abs() <= 1]
    points = torch.cat([threshold, edges])
    around = quantize_fast._ordinal(points)[:, None] + torch.arange(-2, 3)[None, :]
    values = quantize_fast._from_ordinal(around.reshape(-1)).clamp(-1, 1)
    values = torch.cat([values, torch.tensor([1.0, -1.0, 0.0, -0.0])])
    assert torch.equal(
        quantize_fast._fast_codes(fast, values), quantize_fast._reference_codes(kernel, values)
    )


def test_native_codec_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    with_fast = quantize.quantize_to_buffer(x)
    monkeypatch.setenv(quantize.NATIVE_ENV, "0")
    assert not quantize.using_fast_kernel()
    assert quantize.quantize_to_buffer(x) == with_fast  # bitsandbytes' kernels: the same bytes
    monkeypatch.setenv(quantize.NATIVE_ENV, "yes")
    with pytest.raises(ValueError, match=quantize.NATIVE_ENV):
        quantize.quantize_to_buffer(x)


def test_finiteness_of_a_decoded_8bit_tensor_comes_from_its_scales() -> None:
    from lightning_swarm.swarm.wire import codec

    x = torch.randn(4 * quantize.BLOCKSIZE, generator=torch.Generator().manual_seed(8))
    msg = encode_tensor(x, "8bit")
    y = decode_tensor(msg)
    assert getattr(y, codec._FINITE_ATTR) == y._version and codec.all_finite(y)
    y[3] = float("nan")  # modified in place: scanned again, and the NaN is found
    assert not codec.all_finite(y)
    # a hostile scale decodes to non-finite values, and is not trusted
    for bad in (float("inf"), float("nan")):
        forged = runtime_pb2.Tensor()
        forged.CopyFrom(msg)
        buffer = bytearray(forged.buffer)
        buffer[4 + 4 * 2 : 4 + 4 * 3] = torch.tensor([bad]).numpy().tobytes()  # block 2's scale
        forged.buffer = bytes(buffer)
        z = decode_tensor(forged)
        assert not hasattr(z, codec._FINITE_ATTR) and not codec.all_finite(z)
    half = decode_tensor(encode_tensor(x.half() * 1000, "8bit"))  # scales must also fit the dtype
    assert half.dtype == torch.float16 and codec.all_finite(half)
    forged = encode_tensor(x.half(), "8bit")
    buffer = bytearray(forged.buffer)
    buffer[4:8] = torch.tensor([1e6]).numpy().tobytes()  # beyond float16's range: decodes to infinities
    forged.buffer = bytes(buffer)
    assert not codec.all_finite(decode_tensor(forged))


def test_fast_kernel_is_never_built_or_loaded_where_others_can_write(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import shutil
    import tempfile

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    shared = tmp_path / "cache" / "lightning-swarm"
    shared.mkdir(parents=True)
    shared.chmod(0o777)  # another user could swap the library in
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    lib = quantize_fast._compile()
    assert lib is not None  # built in the private fallback directory instead
    assert list(shared.iterdir()) == []
    assert list((private_tmp / f"lightning-swarm-{os.getuid()}").glob("q8-*.so"))


@pytest.mark.parametrize("compression", ["8bit", "fp16", "none"])
def test_tensors_decode_and_check_under_inference_mode(compression: str) -> None:
    """Lightning's validate/test/predict run under torch.inference_mode: inference tensors have no version
    counter, so nothing about them can be remembered, but decoding and checking them must work."""
    from lightning_swarm.swarm.wire import codec

    x = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    msg = encode_tensor(x, compression)
    received = decode_tensor(msg)  # outside inference mode: it remembers its parts (lossy compressions)
    with torch.inference_mode():
        y = decode_tensor(msg)
        assert y.is_inference() and codec.all_finite(y)
        assert torch.allclose(y, x, atol=0.1)
        assert codec.all_finite(torch.randn(4096)) and not codec.all_finite(torch.full((4096,), float("nan")))
        again = encode_tensor(y, compression)  # encoded afresh (no remembered parts), to the same values
        assert torch.equal(decode_tensor(again), y)
        moved = received * 1  # an inference tensor: the received parts cannot be attached to it
        codec.remember_wire_format(received, moved)
        assert not hasattr(moved, codec._WIRE_ATTR)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_float_mask_with_infinities_survives_8bit_compression_exactly(dtype: torch.dtype) -> None:
    """Quantized, a causal mask's 0/-inf blocks would arrive as NaN and +inf (an infinite block scale): the parts
    that hold an infinity travel raw, the finite parts of the same tensor still in 8 bits."""
    from lightning_swarm.swarm.wire.codec import PART_ELEMENTS, WIRE_8BIT, encode_parts

    mask = torch.nn.Transformer.generate_square_subsequent_mask(64).to(dtype)
    (decoded,) = decode_parts(list(encode_parts(mask, "8bit")))
    assert decoded.dtype == dtype and torch.equal(decoded, mask)
    # a large tensor whose infinities sit in its first part only: that part raw, the others quantized
    big = torch.randn(3 * PART_ELEMENTS).to(dtype)
    big[5] = float("-inf")
    parts = list(encode_parts(big, "8bit"))
    assert [p.compression for p in parts] == [0, WIRE_8BIT, WIRE_8BIT]
    (decoded,) = decode_parts(parts)
    assert decoded[5] == float("-inf") and torch.equal(decoded[:PART_ELEMENTS], big[:PART_ELEMENTS])
    assert float((decoded[PART_ELEMENTS:] - big[PART_ELEMENTS:]).abs().max()) < 0.1
    # one tensor's lossy parts must still agree with each other
    other = runtime_pb2.Tensor()
    other.CopyFrom(parts[2])
    other.compression = runtime_pb2.CompressionType.FLOAT16
    with pytest.raises(CodecError, match="different lossy compressions"):
        decode_parts([*parts[:2], other])
