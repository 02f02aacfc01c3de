"""kubetron.checkpoint._hostcopy, the snapshot's copy into host buffers (checkpoint/_hostcopy.c): built by the
install, exact for every size and alignment, and the same bytes through its ctypes fallback."""

from __future__ import annotations

import platform

import pytest
import torch
from kubetron.checkpoint import hostcopy

pytestmark = pytest.mark.unit

PAGE = 4096
# (source offset, destination offset, bytes): around the 64-byte line, the 4-page block and the memcpy
# cut-off of the streaming loop (4 pages + the bytes up to the first destination line), and MBs
SIZES = [0, 1, 63, 64, 65, 4 * PAGE - 1, 4 * PAGE, 4 * PAGE + 63, 4 * PAGE + 64, 4 * PAGE + 65,
         8 * PAGE + 1, 3 * 2**20 + 17]
CASES = [(so, do, n) for n in SIZES for so, do in ((0, 0), (1, 0), (0, 1), (13, 37), (64, 63))]


@pytest.fixture(params=["extension", "fallback"])
def impl(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setattr(hostcopy, "_hostcopy", None)
        assert hostcopy.copy_impl() == "ctypes.memmove"
    return request.param


def test_the_install_built_the_snapshot_copy():
    """`make test`/`make demo` install kubetron with setup.py's extension: a missing compiler would
    leave every async save at libc's speed, which only bench/checkpoint.py shows. This says so."""
    assert hostcopy._hostcopy is not None, ("kubetron.checkpoint._hostcopy was not built: the install needs a C "
                                            "compiler (gcc)")
    x86 = platform.machine() in ("x86_64", "AMD64")
    assert hostcopy.copy_impl() == ("nontemporal" if x86 else "memcpy")


def test_copy_host_copies_exactly_its_ranges_and_nothing_around_them(impl):
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (max(SIZES) + 256,), dtype=torch.uint8, generator=gen)
    for so, do, n in CASES:
        dst = torch.full((n + 256,), 0xA5, dtype=torch.uint8)
        hostcopy.copy_host([(dst.data_ptr() + 64 + do, src.data_ptr() + so, n)])
        assert torch.equal(dst[64 + do:64 + do + n], src[so:so + n]), (so, do, n)
        assert bool((dst[:64 + do] == 0xA5).all()) and bool((dst[64 + do + n:] == 0xA5).all()), (so, do, n)


def test_many_pieces_in_one_call(impl):
    """A snapshot's batch: pieces of every size at once, from several tensors (fp32 state as it is)."""
    sources = [torch.randn(k) for k in (1, 255, 4096, 2**19 + 3, 1)]
    buffers = [torch.empty_like(s) for s in sources]
    hostcopy.copy_host([(b.data_ptr(), s.data_ptr(), s.numel() * 4) for b, s in zip(buffers, sources)])
    for b, s in zip(buffers, sources):
        assert torch.equal(b, s)


@pytest.mark.skipif(hostcopy._hostcopy is None, reason="kubetron.checkpoint._hostcopy not built (the test above fails)")
@pytest.mark.parametrize("items, error", [
    ((1, 2, 3), "expects a list"),
    ([(1, 2)], "item 1 is not a"),  # (item 0 is a good one, put first)
    ([(0, 0, 0), [1, 2, 3]], "item 2 is not a"),
    ([(1, 2, -1)], "item 1: nbytes must be a non-negative int"),
    ([(1, "x", 8)], "item 1: src must be"),
    ([(0, 16, 8)], "item 1: null address"),
])
def test_bad_items_are_refused_before_anything_is_copied(items, error):
    dst, src = torch.zeros(4), torch.ones(4)
    good = (dst.data_ptr(), src.data_ptr(), 16)
    with pytest.raises((TypeError, ValueError), match=error):
        hostcopy._hostcopy.copy_many([good, *items] if isinstance(items, list) else items)
    assert bool((dst == 0).all())  # checked first, then copied: a refused list copies nothing
