"""The one exact comparator every test uses (differential.bitwise_diff / assert_bitwise): what it
tells apart that value comparisons (torch.equal, assert_close with zero tolerance) do not, and
what its message says."""
import pytest
import torch

from differential import assert_bitwise, assert_same, bitwise_diff, bits, snapshot

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


def _nan_with_payload(payload, dtype=torch.float32):
    width = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}[dtype]
    quiet = torch.tensor([float("nan")], dtype=dtype).view(width)
    return (quiet + payload).view(dtype)


def test_signed_zeros_differ_though_values_compare_equal():
    z = torch.zeros(4)
    torch.testing.assert_close(-z, z, rtol=0, atol=0)   # what the old comparison accepted
    d = bitwise_diff(-z, z)
    assert d == ("output (torch.float32(4,)): 4 of 4 elements differ; the first at index (0,): "
                 "got 0x80000000 (-0.0), want 0x00000000 (0.0)")
    with pytest.raises(AssertionError, match="0x80000000"):
        assert_same(-z, z)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_nans_are_equal_only_with_the_same_sign_and_payload(dtype):
    a = torch.tensor([1.0, float("nan"), 2.0], dtype=dtype)
    assert bitwise_diff(a, a.clone()) is None
    other_payload = torch.cat([a[:1], _nan_with_payload(1, dtype), a[2:]])
    assert "at index (1,)" in bitwise_diff(other_payload, a)
    sign = torch.iinfo(bits(a).dtype).min
    negative_nan = torch.cat([a[:1], (bits(a[1:2]) ^ sign).view(dtype), a[2:]])   # neg() keeps a NaN's sign in some kernels
    assert "1 of 3 elements differ; the first at index (1,)" in bitwise_diff(negative_nan, a)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_is_compared_by_its_bits(dtype):
    x = (torch.randn(5, 6, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    assert bitwise_diff(x.clone(), x) is None
    y = x.clone()
    one = bits(y)[2, 3]
    (one[0] if dtype.is_complex else one).bitwise_xor_(1)   # the lowest bit of one element (its real part)
    d = bitwise_diff(y, x)
    assert "1 of" in d and ("index (2, 3) real" if dtype.is_complex else "index (2, 3)") in d, d


def test_strides_of_dimensions_longer_than_one_are_compared():
    x = torch.randn(3, 4)
    assert "strides (1, 3), want (4, 1)" in bitwise_diff(x.t().contiguous().t(), x)
    # a dimension of size 1 addresses no second element: its stride is not compared
    y = torch.randn(3, 1)
    assert y.as_strided((3, 1), (1, 9)).stride() != y.stride() and bitwise_diff(y.as_strided((3, 1), (1, 9)), y) is None
    assert "strides (2, 1), want (1, 1)" in bitwise_diff(torch.randn(6).as_strided((3, 1), (2, 1)), y)
    assert bitwise_diff(x.t(), x.t().contiguous(), strides=False) is None


def test_non_contiguous_expanded_offset_and_empty_tensors():
    base = torch.randn(6, 8)
    view = base[1:, 2::3]                              # an offset and a row stride of 8
    assert bitwise_diff(snapshot(view), view) is None
    assert snapshot(view).stride() == view.stride() and snapshot(view).storage_offset() == view.storage_offset()
    other = snapshot(view)
    bits(other)[4, 1] += 1
    assert "index (4, 1)" in bitwise_diff(other, view)
    expanded = torch.randn(4).expand(3, 4)
    assert snapshot(expanded).stride() == (0, 1) and bitwise_diff(snapshot(expanded), expanded) is None
    assert "strides (4, 1), want (0, 1)" in bitwise_diff(expanded.contiguous(), expanded)
    assert bitwise_diff(torch.empty(0, 3), torch.empty(0, 3)) is None
    assert "shape (0, 3), want (3, 0)" in bitwise_diff(torch.empty(0, 3), torch.empty(3, 0))


def test_conjugate_and_negative_views_compare_by_their_values():
    z = torch.randn(4, dtype=torch.complex64)
    assert bitwise_diff(z.conj(), z.conj().resolve_conj()) is None
    assert "imag" in bitwise_diff(z.conj(), z)
    neg = z.conj().imag                                 # a negative view
    assert neg.is_neg() and bitwise_diff(neg, neg.resolve_neg(), strides=False) is None
    assert bitwise_diff(snapshot(z.conj()), z.conj()) is None


def test_dtype_shape_device_type_and_requires_grad():
    x = torch.randn(3)
    assert "dtype torch.float64, want torch.float32" in bitwise_diff(x.double(), x)
    assert "shape (1, 3), want (3,)" in bitwise_diff(x[None], x)
    assert "type Parameter, want Tensor" in bitwise_diff(torch.nn.Parameter(x), x)
    w = torch.randn(3, requires_grad=True)
    assert "requires_grad False, want True" in bitwise_diff((w * 2).detach(), w * 2)
    assert bitwise_diff((w * 2).detach(), w * 2, requires_grad=False) is None
    if torch.device("meta") != x.device:
        assert "device meta, want cpu" in bitwise_diff(torch.empty(3, device="meta"), x)


def test_trees_and_python_numbers():
    x = torch.randn(2)
    assert bitwise_diff({"a": [x, 1, 2.5]}, {"a": [x.clone(), 1, 2.5]}) is None
    assert bitwise_diff([x, -0.0], [x, 0.0]) == "output[1]: -0.0 (0x8000000000000000), want 0.0 (0x0000000000000000)"
    assert "(a float), want 1 (a int)" in bitwise_diff([1.0], [1])
    assert "1 values, want 2" in bitwise_diff([x], [x, x])
    assert "keys" in bitwise_diff({"a": x}, {"b": x})


def test_assert_bitwise_names_what_it_compared():
    with pytest.raises(AssertionError, match=r"^call 3: output \(torch.float32\(2,\)\): 1 of 2 elements differ"):
        assert_bitwise(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), "call 3: output")
