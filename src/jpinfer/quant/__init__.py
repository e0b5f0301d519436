"""Weight formats for quantized decoding, and their products written in XLA ops.

- ``int8``: one int8 matrix with one float32 scale per output (W8A8: tokens quantized per token);
- ``q4``: llama.cpp's 4-bit blocks of 32 along the input (Q4_0, Q4_1; tokens quantized per block).

Nothing here depends on the model: ``jpinfer.native`` runs the same products as native kernels
(with these XLA forms as its fallback and reference), and ``jpinfer.models.quantized`` picks between
the two per call.
"""
