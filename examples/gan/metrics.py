"""Sample quality for the digit GANs: an inception-style score and class coverage.

A small classifier is trained on real labelled digits (PCA to 40 components,
then a one-hidden-layer MLP, both seeded). For N generated images with class
probabilities p(y|x)::

  score    = exp( mean_x KL( p(y|x) || p(y) ) ),  p(y) = mean_x p(y|x)
  coverage = #{ classes c : argmax_y p(y|x) == c for >= 1% of the images }

The score is 1 when every image gets the same prediction (or the classifier
is unsure about all of them) and at most 10 (ten classes, each image
confidently one class, classes equally frequent). The classifier's own
reference is the score of real digits it did not see during training.

No TensorFlow here: tests import this module directly.
"""

from __future__ import absolute_import, division, print_function

import collections
import warnings

import numpy as np

NUM_CLASSES = 10
# A class counts as covered when at least this fraction of the samples is
# predicted as it: 1% of a 1000-sample batch is 10 images, enough to rule out
# a handful of stray predictions.
COVERAGE_MIN_FRACTION = 0.01
_PCA_COMPONENTS = 40
_HIDDEN_UNITS = 64
_MAX_ITER = 300
_HOLDOUT_FRACTION = 0.2

Reference = collections.namedtuple("Reference", ["classifier", "real_score", "real_accuracy"])


def inception_score(probs):
    """exp(mean KL(p(y|x) || p(y))) of an (N, classes) probability matrix.

    Args:
      probs: array (N, classes), rows summing to 1.

    Returns:
      A float in [1, classes].
    """
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2 or probs.shape[0] == 0:
        raise ValueError("probs must be a non-empty (N, classes) array, got shape %r"
                         % (probs.shape,))
    marginal = probs.mean(axis=0, keepdims=True)
    eps = 1e-12
    kl = np.sum(probs * (np.log(probs + eps) - np.log(marginal + eps)), axis=1)
    return float(np.exp(np.mean(kl)))


def class_coverage(probs, min_fraction=COVERAGE_MIN_FRACTION):
    """Number of classes that are the argmax of >= min_fraction of the rows."""
    probs = np.asarray(probs)
    counts = np.bincount(np.argmax(probs, axis=1), minlength=probs.shape[1])
    return int(np.sum(counts >= min_fraction * probs.shape[0]))


class DigitClassifier(object):
    """PCA + MLP on flattened 16x16 images in [0, 1].

    Args:
      seed: seeds PCA's solver and the MLP's initial weights.
    """

    def __init__(self, seed=0):
        from sklearn.decomposition import PCA
        from sklearn.neural_network import MLPClassifier
        from sklearn.pipeline import make_pipeline
        self._model = make_pipeline(
            PCA(_PCA_COMPONENTS, random_state=seed),
            MLPClassifier(hidden_layer_sizes=(_HIDDEN_UNITS,), max_iter=_MAX_ITER,
                          random_state=seed))

    @staticmethod
    def _flatten(images):
        images = np.asarray(images, dtype=np.float32)
        return images.reshape(images.shape[0], -1)

    def fit(self, images, labels):
        """Fits on (N, H, W) images and (N,) labels 0..9; returns self."""
        with warnings.catch_warnings():
            # An MLP that stops at max_iter is still a fine scorer.
            warnings.simplefilter("ignore")
            self._model.fit(self._flatten(images), np.asarray(labels))
        return self

    def predict_proba(self, images):
        """(N, 10) class probabilities (columns for every digit 0..9)."""
        probs = self._model.predict_proba(self._flatten(images))
        full = np.zeros((probs.shape[0], NUM_CLASSES))
        full[:, self._model.classes_.astype(int)] = probs
        return full

    def score(self, images):
        """(inception_score, class_coverage) of a batch of images."""
        probs = self.predict_proba(images)
        return inception_score(probs), class_coverage(probs)


def reference(images, labels, seed=0):
    """Trains the scorer on 80% of the real digits, scores the other 20%.

    Args:
      images: (N, H, W) real images in [0, 1].
      labels: (N,) integer labels 0..9.
      seed: seeds the split and the classifier.

    Returns:
      A ``Reference``: the fitted classifier, the held-out real images' score
      and the classifier's held-out accuracy.
    """
    labels = np.asarray(labels)
    order = np.random.RandomState(seed).permutation(len(labels))
    cut = int(round(len(labels) * (1.0 - _HOLDOUT_FRACTION)))
    train, held = order[:cut], order[cut:]
    classifier = DigitClassifier(seed).fit(images[train], labels[train])
    probs = classifier.predict_proba(images[held])
    accuracy = float(np.mean(np.argmax(probs, axis=1) == labels[held]))
    return Reference(classifier, inception_score(probs), accuracy)
