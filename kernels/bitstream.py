"""Reading ``BITS``-bit codes out of the GPTQ bit stream (``qcompiler.algorithms.packing``) inside a kernel."""

import triton
import triton.language as tl


@triton.jit
def bits_at(ptr, word_offsets, next_word_stride, shift, mask, BITS: tl.constexpr):
    """Codes whose first bit is bit ``shift`` of the int32 word at ``ptr + word_offsets``.

    For 2/4/8 bits a code never leaves its word; for 3 bits it may spill into the next word along
    the packed dimension (``next_word_stride`` elements further). Shifts are done on uint32 so that
    no sign bits leak into the spilled part.
    """
    low = tl.load(ptr + word_offsets, mask=mask, other=0).to(tl.uint32, bitcast=True)
    value = low >> shift.to(tl.uint32)
    if 32 % BITS != 0:
        spills = mask & (shift + BITS > 32)
        high = tl.load(ptr + word_offsets + next_word_stride, mask=spills, other=0).to(tl.uint32, bitcast=True)
        value = value | tl.where(spills, high << ((32 - shift) % 32).to(tl.uint32), 0)
    return (value & ((1 << BITS) - 1)).to(tl.int32)
