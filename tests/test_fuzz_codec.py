"""Property-based tests (hypothesis) of the boundary codec and the request decoder.

- Any finite tensor survives encode -> decode within the compression's error bound.
- No sequence of received parts makes the decoder raise anything but ``CodecError`` or allocate beyond its
  limit; no header or tensor list makes ``parse_request`` raise anything but ``BadRequest``.
"""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import torch
from hivemind.proto import runtime_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lightning_swarm.swarm.wire import codec
from lightning_swarm.swarm.wire.codec import CodecError, PartsDecoder, TooLarge, decode_parts, encode_parts
from lightning_swarm.swarm.wire.errors import BadRequest
from lightning_swarm.swarm.wire.payload import Payload
from lightning_swarm.swarm.wire.protocol import StageRequest, parse_request, stage_uid
from lightning_swarm.swarm.wire.transport import MessageReceiver, encode_request

UID = stage_uid("fuzz", 0)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_FLOATS = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@st.composite
def finite_tensors(draw) -> torch.Tensor:
    name = draw(st.sampled_from(list(_FLOATS)))
    dtype = _FLOATS[name]
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40))
    if draw(st.booleans()):  # large enough to be compressed (LOSSLESS_BELOW elements), sometimes in parts
        shape = (draw(st.integers(codec.LOSSLESS_BELOW, 3 * codec.PART_ELEMENTS // 64)), 64)
    finfo = torch.finfo(dtype)
    scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30 if name != "float16" else 6e4]))
    numel = math.prod(shape)
    values = draw(
        hnp.arrays(
            np.float64,
            min(numel, 64),
            elements=st.floats(-1.0, 1.0, allow_nan=False, allow_infinity=False),
        )
    )
    # a few drawn values (edge cases) tiled over a random background, clamped to the dtype's range
    base = torch.randn(numel, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31))))
    flat = base.double()
    if numel:
        flat[: len(values)] = torch.from_numpy(values)
    flat = (flat * scale).clamp(-finfo.max, finfo.max)
    return flat.to(dtype).view(shape)


def _error_bound(t: torch.Tensor, compression: str) -> torch.Tensor:
    """The largest error the codec may make on each element of ``t`` (in float64)."""
    x = t.double().abs()
    if compression == "none" or not t.is_floating_point() or t.numel() < codec.LOSSLESS_BELOW:
        return torch.zeros_like(x)
    if compression == "fp16":
        if t.dtype in (torch.float16, torch.bfloat16) or float(x.max()) > 65504:
            return torch.zeros_like(x)  # sent as they are
        return x * 2**-11 + 2**-24  # fp16 rounding, subnormals below 2**-14
    # 8-bit: blockwise dynamic quantization, error relative to each block's absmax (the code's largest gap)
    flat = x.reshape(-1)
    bounds = []
    for start in range(0, flat.numel(), codec.BLOCKSIZE):
        block = flat[start : start + codec.BLOCKSIZE]
        bounds.append(torch.full_like(block, float(block.max()) * 0.02))
    bound = torch.cat(bounds).view(x.shape)
    if t.dtype in (torch.float16, torch.bfloat16):  # the result is rounded to the tensor's own dtype
        bound = bound + x * 2 ** -(8 if t.dtype == torch.bfloat16 else 11)
    return bound


@FAST
@given(t=finite_tensors(), compression=st.sampled_from(codec.COMPRESSIONS), split=st.booleans())
def test_any_finite_tensor_survives_encoding_within_the_error_bound(t, compression, split) -> None:
    (decoded,) = decode_parts(list(encode_parts(t, compression, split=split)))
    assert decoded.dtype == t.dtype and decoded.shape == t.shape
    assert bool(torch.isfinite(decoded).all())
    error = (decoded.double() - t.double()).abs()
    assert bool((error <= _error_bound(t, compression)).all()), float(
        (error - _error_bound(t, compression)).max()
    )


_DTYPE_NAMES = [*codec._DTYPES, "float8", "", "int128", "\x00"]
_COMPRESSIONS = [0, 1, 2, 3, 4, 5, codec.WIRE_8BIT, 2**31 - 1]


@st.composite
def tensor_parts(draw) -> runtime_pb2.Tensor:
    msg = runtime_pb2.Tensor()
    msg.dtype = draw(st.sampled_from(_DTYPE_NAMES))
    msg.size.extend(draw(st.lists(st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1)), max_size=5)))
    msg.compression = draw(st.sampled_from(_COMPRESSIONS))
    msg.chunks = draw(st.one_of(st.integers(0, 4), st.integers(-(2**31), 2**31 - 1)))
    msg.requires_grad = draw(st.booleans())
    if draw(st.booleans()) and msg.compression == codec.WIRE_8BIT:  # a plausible 8-bit header
        block = draw(st.sampled_from([*codec.VALID_BLOCKSIZES, 0, 3, 2**32 - 1]))
        msg.buffer = block.to_bytes(4, "little") + draw(st.binary(max_size=2048))
    else:
        msg.buffer = draw(st.binary(max_size=2048))
    return msg


@FAST
@given(parts=st.lists(tensor_parts(), max_size=6), max_bytes=st.sampled_from([4096, 1 << 16, 1 << 20]))
def test_the_parts_decoder_raises_only_codec_errors_and_stays_within_its_limit(parts, max_bytes) -> None:
    decoder = PartsDecoder(max_bytes=max_bytes)
    try:
        for part in parts:
            decoder.feed(part)
        tensors = decoder.finish()
    except CodecError as e:
        assert str(e)
        if isinstance(e, TooLarge):
            assert "limit" in str(e) or "tensors" in str(e)
        return
    assert sum(t.numel() * t.element_size() for t in tensors) <= max_bytes


def _valid_request(backward: bool, requires_grad: bool | None = None) -> runtime_pb2.ExpertRequest:
    x = torch.randn(2, 8, requires_grad=backward if requires_grad is None else requires_grad)
    grads = Payload.flatten((torch.randn(2, 8),)) if backward else None
    request = StageRequest("backward" if backward else "forward", UID, Payload.call((x,), {"k": 1}), grads, 5)
    metadata, encoded = encode_request(request, "none")
    return runtime_pb2.ExpertRequest(tensors=[p for e in encoded for p in e.parts()], metadata=metadata)


_msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=8),
        st.binary(max_size=16),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=5), st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=20,
)


@st.composite
def request_headers(draw) -> bytes:
    """Garbage, arbitrary msgpack, or a valid header with one field (or its payload metadata) replaced."""
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=256))
    if kind == 1:
        return msgpack.packb(draw(_msgpack_values), use_bin_type=True)
    fields = msgpack.unpackb(_valid_request(draw(st.booleans())).metadata)
    index = draw(st.integers(0, len(fields) - 1))
    if kind == 2 or not isinstance(fields[index], bytes):
        fields[index] = draw(_msgpack_values)
    else:  # a payload's metadata: [skeleton, count] with a random skeleton or count
        fields[index] = msgpack.packb(
            draw(st.one_of(_msgpack_values, st.tuples(_msgpack_values, st.integers(-3, 2**40)).map(list))),
            use_bin_type=True,
        )
    return msgpack.packb(fields, use_bin_type=True)


@FAST
@given(header=request_headers(), parts=st.lists(tensor_parts(), max_size=3), keep=st.integers(0, 3))
def test_the_request_decoder_raises_only_bad_request(header, parts, keep) -> None:
    good = _valid_request(backward=keep % 2 == 1)
    messages = [runtime_pb2.ExpertRequest(tensors=[*good.tensors[:keep], *parts], metadata=header)]
    receiver = MessageReceiver(max_bytes=1 << 20, max_tensors=16)
    assert receiver.feed(messages[0]) == bool(header)
    try:
        received_header, tensors = receiver.result()
        request = parse_request(received_header, tensors, UID)
    except (CodecError, BadRequest) as e:  # CodecError only from the receiver, before parsing
        assert str(e)
        return
    # whatever was accepted is a well-formed request of this stage
    assert request.uid == UID and request.kind in ("forward", "backward")
    args, kwargs = request.inputs.rebuild_call()
    assert isinstance(args, tuple) and isinstance(kwargs, dict)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_activations_and_gradients_are_bad_requests(value: float) -> None:
    """NaN is refused everywhere; an infinity in an input that requires grad (an activation) and in an output
    gradient. A float mask's -inf is allowed: see the next test."""
    for backward, requires_grad in ((False, True), (True, True), (True, False)):
        good = _valid_request(backward, requires_grad)
        tensors = decode_parts(good.tensors)
        with torch.no_grad():  # the output gradient of a backward, else the input
            tensors[-1].view(-1)[3] = value
        with pytest.raises(BadRequest, match="NaN or infinite"):
            parse_request(good.metadata, tensors, UID)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_inputs_that_need_no_grad_are_data_and_may_hold_infinities(value: float) -> None:
    """A float mask with -inf (``nn.Transformer.generate_square_subsequent_mask``) is data: accepted untouched.
    NaN is not a value anyone means to send: refused in data too."""
    for backward in (False, True):
        good = _valid_request(backward, requires_grad=False)
        tensors = decode_parts(good.tensors)
        tensors[0].view(-1)[3] = value
        if math.isnan(value):
            with pytest.raises(BadRequest, match="NaN values"):
                parse_request(good.metadata, tensors, UID)
        else:
            request = parse_request(good.metadata, tensors, UID)
            assert request.inputs.tensors[0].view(-1)[3] == value
