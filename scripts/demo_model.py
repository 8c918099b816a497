"""NumPy pieces of the gradsync demo: synthetic data, a small MLP, an optimizer.

Nothing here knows about MPI or gradsync; ``scripts/demo.py`` does the
distributed part.  Everything is float32 and deterministic for a given seed, so
every rank can build the same dataset and take its own shard of it.
"""

import numpy as np

DTYPE = np.float32


# ---------------------------------------------------------------------------
# data: 10 classes, each a mixture of a few Gaussian blobs (not linearly separable)
# ---------------------------------------------------------------------------

def make_dataset(seed, n_train, n_test, n_in=32, n_classes=10, blobs_per_class=3,
                 separation=3.0):
    """Return (x_train, y_train, x_test, y_test), identical on every caller.

    Each class owns ``blobs_per_class`` random centres; a sample is a centre plus
    unit Gaussian noise, labelled with the centre's class.  Blobs overlap enough
    that the classes are not trivially separable, and a class's blobs are far
    apart, so a linear model cannot fit it but the MLP can.
    """
    rng = np.random.default_rng([seed, 0xDA7A])
    n = n_train + n_test
    n_blobs = n_classes * blobs_per_class
    centres = rng.standard_normal((n_blobs, n_in)) * (separation * np.sqrt(2.0 / n_in))
    blob = rng.integers(0, n_blobs, n)
    x = (centres[blob] + rng.standard_normal((n, n_in))).astype(DTYPE)
    y = (blob % n_classes).astype(np.int64)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


# ---------------------------------------------------------------------------
# model: in -> hidden -> hidden -> classes, ReLU, softmax cross-entropy
# ---------------------------------------------------------------------------

PARAM_NAMES = ("w1", "b1", "w2", "b2", "w3", "b3")


def layer_sizes(n_in, hidden, n_classes):
    return [(n_in, hidden), (hidden, hidden), (hidden, n_classes)]


def init_params(rng, n_in, hidden, n_classes):
    """He-initialised weights, zero biases; a list of C-contiguous float32 arrays."""
    params = []
    for fan_in, fan_out in layer_sizes(n_in, hidden, n_classes):
        w = rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)
        params.append(np.ascontiguousarray(w, dtype=DTYPE))
        params.append(np.zeros(fan_out, dtype=DTYPE))
    return params


def forward(params, x):
    w1, b1, w2, b2, w3, b3 = params
    z1 = x @ w1 + b1
    h1 = np.maximum(z1, 0)
    z2 = h1 @ w2 + b2
    h2 = np.maximum(z2, 0)
    logits = h2 @ w3 + b3
    return logits, (x, z1, h1, z2, h2)


def softmax_xent(logits, y):
    """Return (per-sample loss, probabilities)."""
    m = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - m)
    s = e.sum(axis=1, keepdims=True)
    p = e / s
    loss = (np.log(s[:, 0]) + m[:, 0]) - logits[np.arange(len(y)), y]
    return loss, p


def loss_and_grads(params, x, y, grads):
    """Mean cross-entropy over the batch; writes d(loss)/d(param) into ``grads``.

    ``grads`` is a list of preallocated arrays shaped like ``params`` (so the
    same buffers go to the allreduce every step).  Returns (loss_sum, n_correct).
    """
    w1, b1, w2, b2, w3, b3 = params
    logits, (x, z1, h1, z2, h2) = forward(params, x)
    loss, p = softmax_xent(logits, y)
    n = len(y)
    d = p
    d[np.arange(n), y] -= 1.0
    d *= DTYPE(1.0 / n)                      # d loss_mean / d logits
    np.matmul(h2.T, d, out=grads[4])
    np.sum(d, axis=0, out=grads[5])
    d = d @ w3.T
    d *= (z2 > 0)
    np.matmul(h1.T, d, out=grads[2])
    np.sum(d, axis=0, out=grads[3])
    d = d @ w2.T
    d *= (z1 > 0)
    np.matmul(x.T, d, out=grads[0])
    np.sum(d, axis=0, out=grads[1])
    correct = int(np.count_nonzero(np.argmax(logits, axis=1) == y))
    return float(loss.sum(dtype=np.float64)), correct


def evaluate(params, x, y, chunk=4096):
    """Return (loss_sum, n_correct) over all of x, y."""
    loss_sum, correct = 0.0, 0
    for i in range(0, len(y), chunk):
        logits, _ = forward(params, x[i:i + chunk])
        loss, _ = softmax_xent(logits, y[i:i + chunk])
        loss_sum += float(loss.sum(dtype=np.float64))
        correct += int(np.count_nonzero(np.argmax(logits, axis=1) == y[i:i + chunk]))
    return loss_sum, correct


# ---------------------------------------------------------------------------
# optimizer: SGD with (heavy-ball) momentum, in place, elementwise only
# ---------------------------------------------------------------------------

class SGDMomentum:
    def __init__(self, params, lr, momentum=0.9):
        self.lr = DTYPE(lr)
        self.momentum = DTYPE(momentum)
        self.velocity = [np.zeros_like(p) for p in params]

    def step(self, params, grads):
        for p, g, v in zip(params, grads, self.velocity):
            v *= self.momentum
            v += g
            p -= self.lr * v
