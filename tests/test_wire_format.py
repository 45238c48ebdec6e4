"""`ddpkit.distributed.wire_format`: what ranks send each other, as JSON and raw tensor bytes, never pickled.

Round trips of the values ranks exchange (module and optimizer state dicts, settings, reports, errors; random
nested values drawn by hypothesis), exact to the bit; values it cannot send refused on the sender, naming their
type; bytes that are not its format (a pickle among them) refused on the receiver without running anything."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ddpkit.distributed.wire_format import decode, encode
from ddpkit.fault_tolerance.manager import StoreLost


def same(a: object, b: object) -> bool:
    """Equal values of equal types, tensors bit for bit, NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def test_a_module_and_an_optimizer_state_dict_come_back_bit_for_bit_and_load():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    back = decode(encode(state))
    assert same(dict(back["model"]), dict(state["model"])) and same(back["optimizer"], state["optimizer"])
    assert back["model"]._metadata == state["model"]._metadata  # (module versions: BatchNorm's, for example)
    assert list(back["optimizer"]["state"]) == [0, 1, 2, 3]  # integer keys stay integers
    nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).load_state_dict(back["model"])
    torch.optim.Adam(model.parameters()).load_state_dict(back["optimizer"])


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64, torch.uint8]
)
def test_tensors_of_every_dtype_and_shape_come_back_exactly(dtype):
    for shape in ((), (0,), (3,), (2, 0, 3), (4, 5)):
        tensor = (torch.randn(shape) * 100).to(dtype) if dtype != torch.bool else torch.rand(shape) > 0.5
        assert same(decode(encode(tensor)), tensor), (dtype, shape)
    strided = torch.arange(12.0).reshape(3, 4).t()  # not contiguous: sent as its values
    assert torch.equal(decode(encode(strided)), strided)


scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text() | st.binary()
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.integers(-5, 5) | st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(values)
def test_any_nested_value_of_the_supported_kinds_comes_back_equal(value):
    assert same(decode(encode(value)), value)


def test_an_error_arrives_as_its_type_and_message():
    assert type(decode(encode(ValueError("bad lr")))) is ValueError
    lost = decode(encode(StoreLost("the store is gone")))
    assert type(lost) is StoreLost and str(lost) == "the store is gone"

    class Unknown(Exception):
        def __init__(self, a: int, b: int) -> None:  # a constructor that wants more than a message
            super().__init__(f"{a} {b}")

    got = decode(encode(Unknown(1, 2)))
    assert type(got) is RuntimeError and "Unknown: 1 2" in str(got)


def test_a_value_it_cannot_send_is_refused_on_the_sender_naming_its_type():
    class Custom:
        pass

    with pytest.raises(TypeError, match=r"cannot send a .*Custom between ranks"):
        encode({"state": [Custom()]})
    with pytest.raises(TypeError, match=r"cannot send a torch\.sparse_coo tensor"):
        encode(torch.eye(2).to_sparse())


def test_bytes_that_are_not_its_format_are_refused_and_nothing_runs():
    """A pickle that would run code when unpickled (a __reduce__ calling a function) is refused as data."""
    ran = []

    class Payload:
        def __reduce__(self):
            return (ran.append, ("unpickled",))

    buffer = io.BytesIO()
    torch.save(Payload(), buffer)
    pickled = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    with pytest.raises(ValueError):
        decode(pickled)
    assert ran == []
    good = encode({"a": torch.ones(3)})
    for broken in (good[:5], good[:-1], torch.cat([good, torch.zeros(1, dtype=torch.uint8)])):
        with pytest.raises(ValueError):
            decode(broken)
