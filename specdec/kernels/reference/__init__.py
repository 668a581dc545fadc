"""The reference twin of every kernel: numpy (and torch, for the race's noise) computing the same operations in the
same order as rows.cpp's headers, so that tests compare the kernels with them bitwise, on both instruction sets.
One module per header, under the header's name:

    simd.h       -> simd.py       fma32, the 16-lane sum tree, exp, silu, gelu
    formats.h    -> formats.py    FORMAT_TABLE's blocks dequantized (gguf's own reference)
    linear.h     -> linear.py     the exact linear: 16 lanes, one FMA per 16 columns, the lane tree
    q8_repack.h  -> q8.py         int8 activations per 32-column block; every format as the q8 layout it runs as
    q8_sums.h    -> q8.py         exact integer block sums
    q8_amx.h     -> q8.py         the same sums by AMX tiles
    q8_linear.h  -> q8.py         the sums scaled, one fp32 chain per output
    norms.h      -> norms.py      RMSNorm, rotary
    attention.h  -> attention.py  scores, softmax and values over a row's logical keys (plain, windowed, tree)
    layer.h      -> layer.py      a decoder layer, and a whole pass from token ids to logits
    selection.h  -> selection.py  top-k, argmax, the race and its noise

Slow by design (a Python loop per FMA chain step): for tests on tiny models, not for decoding.
"""
