"""The largest difference two fp32 programs computing the same function may show.

A dot product of length n rounded in fp32 is within gamma_n = n u (u = 2^-24, half of fp32's
epsilon) of the exact one, relative to sum |x_i y_i| (Higham, Accuracy and Stability of Numerical
Algorithms, 2nd ed., Eq. 3.5). Two programs that sum the same products in different orders
(another kernel, chunked against recurrent, another CPU's vector width) are each within that of
the exact value, so within 2 n u = n eps of each other. Through a residual stack of L layers the
per-layer errors add: an output of magnitude M differs by at most L n eps M, where n is the
longest reduction in a layer (model width, MLP width, or attended sequence length). This is a
worst case; seen differences are one to two orders below it, and they vary between CPU models
(sums split over 8 or 16 lanes), which is why tests bound by it and not by one CPU's output.
"""

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 2^-23


def fp32_bound(n_layers: int, reduction: int, magnitude: float) -> float:
    """L n eps M: see the module docstring."""
    return n_layers * reduction * EPS32 * float(magnitude)
