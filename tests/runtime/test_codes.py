"""Code packing (kvfold.runtime.codes): every code of 8, 4, 3 and 2 bits back exactly, packed densely
by planes (4 and 2 bits) and little-endian (3 bits)."""

from __future__ import annotations

import pytest
import torch

from kvfold.runtime.codes import INT_BITS, pack_codes, unpack_codes


@pytest.mark.parametrize("bits", INT_BITS)
def test_packing_round_trips_every_code_exactly(bits):
    codes = torch.randint(0, 1 << bits, (7, 3, 64), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 3, 64 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)
    # every code has its own bits: changing one code changes exactly its own unpacked value
    codes[0, 0, 5] = (int(codes[0, 0, 5]) + 1) % (1 << bits)
    assert torch.equal(unpack_codes(pack_codes(codes, bits), bits), codes)


def test_packing_is_dense_by_planes_and_little_endian():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]], dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [[0x51, 0x62, 0x73, 0x04]]  # by planes: code j and code j + 4
    word = sum(c << (3 * i) for i, c in enumerate(codes[0].tolist()))
    assert pack_codes(codes, 3).tolist() == [[word & 0xFF, (word >> 8) & 0xFF, word >> 16]]
