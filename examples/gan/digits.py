"""The examples' data: handwritten digits as 16x16 float32 images in [0, 1].

* By default, scikit-learn's bundled digits (``load_digits``: 1797 images of
  8x8 pixels with values 0..16, shipped inside the wheel, no download),
  upsampled to 16x16.
* ``load_npz(path)``: a local MNIST-style ``.npz`` with an ``x_train`` array of
  shape (N, H, W) or (N, H, W, 1), and optionally ``y_train`` labels; the
  images are resized to 16x16.

Resizing is a separable linear filter written with numpy (a triangle filter,
widened when shrinking so that 28x28 -> 16x16 averages instead of aliasing),
so no image library is needed and the result is deterministic.

This module does not import TensorFlow: the scripts validate their data
before they start TF.
"""

from __future__ import absolute_import, division, print_function

import numpy as np

SIZE = 16


class DataError(ValueError):
    """A data file that cannot be used; the message is one line."""


def _resize_matrix(n_in, n_out):
    """(n_out, n_in) weights of a triangle-filter resampling along one axis."""
    scale = n_in / float(n_out)
    support = max(scale, 1.0)  # filter half-width in input pixels
    weights = np.zeros((n_out, n_in), dtype=np.float64)
    for i in range(n_out):
        center = (i + 0.5) * scale - 0.5
        taps = np.arange(n_in)
        w = np.maximum(0.0, 1.0 - np.abs(taps - center) / support)
        if w.sum() == 0.0:  # cannot happen for n_out >= 1, kept as a guard
            w[int(np.clip(round(center), 0, n_in - 1))] = 1.0
        weights[i] = w / w.sum()
    return weights


def resize(images, size=SIZE):
    """Resizes (N, H, W) images to (N, size, size) float32.

    Args:
      images: array of shape (N, H, W).
      size: the output height and width.

    Returns:
      A float32 array of shape (N, size, size).
    """
    images = np.asarray(images, dtype=np.float64)
    rows = _resize_matrix(images.shape[1], size)
    cols = _resize_matrix(images.shape[2], size)
    out = np.einsum("ah,nhw,bw->nab", rows, images, cols)
    return out.astype(np.float32)


def load_digits(size=SIZE):
    """scikit-learn's digits, upsampled to size x size, values in [0, 1].

    Returns:
      (images, labels): float32 (1797, size, size) and int64 (1797,).
    """
    from sklearn.datasets import load_digits as _sk_load_digits
    bunch = _sk_load_digits()
    images = resize(bunch.images / 16.0, size)
    return np.clip(images, 0.0, 1.0), bunch.target.astype(np.int64)


def load_npz(path, size=SIZE):
    """A local MNIST-style .npz, resized to size x size, values in [0, 1].

    Args:
      path: path of a ``.npz`` holding ``x_train`` (N, H, W) or (N, H, W, 1),
        and optionally ``y_train`` (N,) integer labels 0..9.
      size: the output height and width.

    Returns:
      (images, labels): float32 (N, size, size), and int64 (N,) or None.

    Raises:
      DataError: a one-line reason when the file is missing or malformed.
    """
    try:
        archive = np.load(path, allow_pickle=False)
    except (IOError, OSError) as error:
        raise DataError("--data %r cannot be read: %s" % (
            path, getattr(error, "strerror", None) or error))
    except ValueError:
        raise DataError("--data %r is not a .npz archive; pass a file saved with "
                        "numpy.savez(path, x_train=...)" % (path,))
    if not hasattr(archive, "files"):
        raise DataError("--data %r is a single .npy array, not a .npz archive; pass "
                        "a file saved with numpy.savez(path, x_train=...)" % (path,))
    with archive:
        if "x_train" not in archive.files:
            raise DataError("--data %r has no x_train array (it has %s); save the "
                            "images as numpy.savez(path, x_train=...)"
                            % (path, ", ".join(archive.files) or "nothing"))
        try:
            x = archive["x_train"]
            y = archive["y_train"] if "y_train" in archive.files else None
        except ValueError as error:  # object arrays need pickle
            raise DataError("--data %r: x_train cannot be loaded without pickle (%s); "
                            "store it as a numeric array" % (path, error))
    if x.ndim == 4 and x.shape[-1] == 1:
        x = x[..., 0]
    if x.ndim != 3 or x.shape[0] == 0 or min(x.shape[1:]) < 4:
        raise DataError("--data %r: x_train must have shape (N, H, W) or (N, H, W, 1) "
                        "with N >= 1 and H, W >= 4, got %s" % (path, x.shape))
    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        raise DataError("--data %r: x_train must be numeric, got dtype %s"
                        % (path, x.dtype))
    x = x.astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise DataError("--data %r: x_train holds inf or nan values" % (path,))
    low, high = float(x.min()), float(x.max())
    if low < 0.0 or high <= 0.0:
        raise DataError("--data %r: x_train values must be >= 0 with a positive "
                        "maximum (0..255 or 0..1), got range [%g, %g]" % (path, low, high))
    x = x / (255.0 if high > 1.0 else 1.0)
    images = np.clip(resize(x, size), 0.0, 1.0)
    labels = None
    if y is not None:
        y = np.asarray(y)
        if (y.shape == (x.shape[0],) and np.issubdtype(y.dtype, np.integer)
                and y.min() >= 0 and y.max() <= 9):
            labels = y.astype(np.int64)
    return images, labels
