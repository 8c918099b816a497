"""Float64 NumPy reference for gradsync's Adasum (docs/GUIDE.md section 5).

Written from the contract only, independently of the C runtime:

* pair rule, every product and sum in float64::

      dot = <a,b>,  A = <a,a>,  B = <b,b>
      ca = 1 - dot/(2A)  if A >= sqrt(DBL_MIN) else 1
      cb = 1 - dot/(2B)  if B >= sqrt(DBL_MIN) else 1
      adasum(a, b) = ca*a + cb*b

* power-of-two P: the balanced tree of the vector-halving distance-doubling
  algorithm, which pairs ranks by ``rank XOR level``: level 1 combines
  (0,1), (2,3), ...; level 2 combines the result of {0,1} with that of
  {2,3}, ...  so for 8 ranks the tree is
  ``((g0,g1),(g2,g3)),((g4,g5),(g6,g7))``;
* any other P: Q = largest power of two <= P; ``h_i = adasum(g_i, g_{Q+i})``
  for i < P-Q, ``h_i = g_i`` for the other i < Q; the tree runs over
  h_0..h_{Q-1}; every rank gets the same result;
* per tensor (a fused list is never treated as one vector);
* prescale multiplies every input, postscale the result (Adasum is
  scale-equivariant: adasum(s*a, s*b) = s*adasum(a, b) for any s != 0).

``store`` (a NumPy dtype) optionally emulates the implementation's storage:
inputs scaled by prescale, every intermediate vector of the tree and the
postscaled result are rounded to that dtype, as they are when the runtime
keeps them in the tensor's dtype.  Without ``store`` everything stays float64.
"""

import math

import numpy as np

DBL_MIN = float(np.finfo(np.float64).tiny)
NORM_THRESHOLD = math.sqrt(DBL_MIN)  # A, B below this: coefficient 1


def _f64(x):
    return np.asarray(x, dtype=np.float64).reshape(-1)


def _round(x, store):
    if store is None or np.dtype(store) == np.float64:
        return x
    return np.asarray(x).astype(store).astype(np.float64)


def pair_coefficients(a, b):
    """(ca, cb) of adasum(a, b) for two 1-D float64 vectors."""
    a = _f64(a)
    b = _f64(b)
    dot = float(np.dot(a, b))
    A = float(np.dot(a, a))
    B = float(np.dot(b, b))
    ca = 1.0 - dot / (2.0 * A) if A >= NORM_THRESHOLD else 1.0
    cb = 1.0 - dot / (2.0 * B) if B >= NORM_THRESHOLD else 1.0
    return ca, cb


def adasum_pair(a, b, store=None):
    """adasum(a, b) = ca*a + cb*b in float64 (rounded to ``store`` if given)."""
    a = _f64(a)
    b = _f64(b)
    ca, cb = pair_coefficients(a, b)
    return _round(ca * a + cb * b, store)


def largest_power_of_two(p):
    q = 1
    while q * 2 <= p:
        q *= 2
    return q


def tree_levels(p):
    """Number of successive adasum steps a value goes through (depth of the
    tree): log2(Q), plus one for the pre-combining step when P is not a
    power of two."""
    q = largest_power_of_two(p)
    return int(math.log2(q)) + (1 if q != p else 0)


def adasum_vectors(vectors, store=None, trace=None):
    """Adasum over ranks of one tensor: ``vectors[r]`` is rank r's (already
    prescaled) tensor.  Returns a flat float64 array.  ``trace``, a list,
    receives every intermediate vector (for tolerance estimates)."""
    vs = [_f64(v) for v in vectors]
    p = len(vs)
    if p == 0:
        raise ValueError("no ranks")
    n = vs[0].size
    if any(v.size != n for v in vs):
        raise ValueError("ranks hold tensors of different sizes")
    q = largest_power_of_two(p)
    h = list(vs[:q])
    for i in range(p - q):
        h[i] = adasum_pair(vs[i], vs[q + i], store)
        if trace is not None:
            trace.append(h[i])
    while len(h) > 1:
        h = [adasum_pair(h[2 * k], h[2 * k + 1], store)
             for k in range(len(h) // 2)]
        if trace is not None:
            trace.extend(h)
    return h[0]


def adasum_reference(per_rank, prescale=1.0, postscale=1.0, store=None,
                     trace=None):
    """Adasum of one tensor over ranks: ``per_rank[r]`` is rank r's array.

    Returns a float64 array of the tensor's shape.  With ``store`` the
    prescaled inputs, the intermediate vectors and the result are rounded to
    that dtype (what the runtime stores); without it, the exact float64
    value of the contract's formula."""
    shape = np.shape(per_rank[0])
    vs = [_round(_f64(v) * prescale, store) if prescale != 1.0 else _f64(v)
          for v in per_rank]
    if trace is not None:
        trace.extend(vs)
    res = adasum_vectors(vs, store, trace)
    if postscale != 1.0:
        res = _round(res * postscale, store)
    return res.reshape(shape)


def adasum_reference_list(per_rank_lists, prescale=1.0, postscale=1.0,
                          store=None):
    """Per-tensor Adasum of fused lists: ``per_rank_lists[r][i]`` is rank
    r's tensor i.  Returns a list of float64 arrays (one per tensor)."""
    ntensors = len(per_rank_lists[0])
    return [adasum_reference([lst[i] for lst in per_rank_lists], prescale,
                             postscale, store)
            for i in range(ntensors)]


def adasum_with_magnitude(per_rank, prescale=1.0, postscale=1.0, store=None):
    """(reference, magnitude): the reference as adasum_reference, and the
    largest absolute value among the (prescaled) inputs and every
    intermediate vector of the tree, times |postscale| -- the scale that a
    rounding error of the result is relative to."""
    trace = []
    ref = adasum_reference(per_rank, prescale, postscale, store, trace)
    mag = 0.0
    for v in trace:
        if v.size:
            mag = max(mag, float(np.max(np.abs(v))))
    return ref, mag * abs(postscale)


def relative_l2_error(got, ref):
    got = _f64(got)
    ref = _f64(ref)
    den = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(got - ref))
    if den == 0.0:
        return num
    return num / den


if __name__ == "__main__":  # standalone self-check (no MPI)
    def close(x, y, atol=1e-12):
        return np.allclose(np.asarray(x, dtype=np.float64), y, rtol=0,
                           atol=atol)

    cases2 = [([1, 0], [0, 1], [1, 1]), ([1, 2], [2, 4], [1.5, 3]),
              ([0, 0], [3, 4], [3, 4]), ([1, 0], [-1, 0], [0, 0]),
              ([1, 1], [1, 0], [1.25, 0.75])]
    for a, b, want in cases2:
        got = adasum_reference([np.array(a, float), np.array(b, float)])
        assert close(got, want), (a, b, got, want)
    got = adasum_reference([np.array(v, float) for v in
                            ([1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 0, 2])])
    assert close(got, [4 / 3, 4 / 3, 5 / 3]), got
    x, y = np.array([4., 5, 6]), np.array([7., 8, 9])
    assert close(adasum_reference([x, y]), [5.6301, 6.5235, 7.4169], 1e-4)
    assert close(adasum_reference([y, x]), [5.6301, 6.5235, 7.4169], 1e-4)
    got = adasum_reference([np.array([4., 5, 6, 7]), np.array([8., 9, 10, 11])])
    assert close(got, [6.2643, 7.1228, 7.9812, 8.8397], 1e-4), got
    # parallel vectors: adasum(s1 v, s2 v) = (s1 + s2)/2 v
    v = np.array([1., -2, 3])
    assert close(adasum_reference([2 * v, 6 * v]), 4 * v)
    # scale equivariance
    rng = np.random.default_rng(0)
    g = [rng.standard_normal(17) for _ in range(6)]
    assert close(adasum_reference(g, prescale=-3.0), -3 * adasum_reference(g))
    # subnormal kept
    t = np.zeros(3, np.float32)
    t[1] = np.float32(1e-40)
    got = adasum_reference([t] + [np.zeros(3, np.float32)] * 4, store=np.float32)
    assert got[1] == float(np.float32(1e-40)), got
    print("adasum_reference self-check OK")
