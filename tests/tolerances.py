"""Named numeric tolerances shared by the tests, and where their sizes come from.

u = U32 = 2^-24 is float32's unit roundoff: one rounding moves a value by at most u relative. The rounding
errors of a float32 sum of n terms add up like a random walk, sigma ~ u * sqrt(n) * |partial sums| (the
worst case is n * u * sum|terms|). The tests compare float32 results with float64 references, or two
float32 programs that sum in different orders (XLA's fusion choices; another CPU's SIMD width), so each
bound is derived from the problem's sizes and set well above sigma; "measured" is this machine (x86 CPU).
Another summation order changes the signs of the rounding errors, not their size.

The tests run on the CPU (conftest.py), which computes float32 matmuls in full float32; conftest also asks
for full float32 if a GPU platform is chosen, where XLA's default for float32 matmuls is TF32 (u = 2^-11).
"""

U32 = 2.0**-24  # float32 unit roundoff

# Sparse FFN outputs y against the float64 reference, or two float32 paths that sum the neurons in different
# orders (test_kernels*.py). Inputs are O(1): gate/up sum d <= 192 products with O(1) partial sums
# (sigma ~ sqrt(192) u ~ 8e-7); y sums <= 96 neuron terms, carrying those errors times |w_down| ~ 0.1, plus
# its own rounding, sigma ~ sqrt(96) u |y| = 6e-7 |y|: sigma_y <~ 1e-6 (1 + |y|), and the tolerance
# 1e-5 (1 + |y|) is 10 sigma_y (the relative part matters where unscaled weights make |y| ~ 70). Measured:
# <= 6.4e-7 against float64, <= 15% of the tolerance between two float32 paths. A wrong or missing neuron
# moves y by ~0.1.
KERNEL_RTOL = KERNEL_ATOL = 1e-5

# Logits (|logit| <= 7.5) and final hidden states (|h| <= 3.2) of the tiny 2-layer decoders (d = 32): float32
# against transformers in float64, or two float32 programs (sparse FFN vs dense: same values, neurons summed
# in another order). One forward pass chains ~500 roundings (2 layers of ~250: norms, projections, attention,
# FFN), sigma ~ sqrt(500) u |logit| ~ 1e-5 at |logit| = 7.5; 1e-4 is 10 sigma. Measured <= 4.4e-6.
DECODER_ATOL = 1e-4

# Perplexity exp(mean NLL) from float32 NLLs (logsumexp over V = 40 logits of size <= 5, summed over <= 75
# tokens) against float64 NLLs of float32 logits (the batch shapes differ, so XLA may round the logits
# differently, ~u |logit|). An absolute error e of the mean NLL is a relative error e of the perplexity:
# per token <= ~u (|lse| + |logit|) * 3 ~ 2e-6, and the float32 sum of 75 NLLs of ~4.5 adds
# sqrt(75) u * 4.5 ~ 2.3e-6; 1e-5 is 4x that pessimistic estimate. Measured <= 1.6e-7.
PPL_RTOL = 1e-5

# Fraction of neuron scores at or below a calibrated threshold vs the requested sparsity. The threshold is
# interpolated linearly inside the histogram bin (1/64 of an octave wide) that holds the quantile, so the
# fraction is off only by how unevenly the scores fill that one bin (the bins there hold 0.14% to 1.7% of a
# layer's scores, and fill them nearly evenly): measured <= 0.12% on the tiny models, 8x below 0.01. float32
# rounding moves at most a score or two of the 12288 per layer across a threshold (~1e-4).
SPARSITY_ATOL = 0.01
