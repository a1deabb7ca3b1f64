"""Transforms composed: ``chain(*transforms)``, and what a group's
``add(transform_grads_fn=...)`` may be (one transform, a function, or a
chain of them)."""

from __future__ import absolute_import, division, print_function

from npu_lossscale import seams as _seams
from npu_lossscale.transforms import transform_fn as _transform_fn


class Chain(_seams.GradientTransform):
    """Several transforms as one, applied in order (optax's ``chain``).

    A group given a chain takes its transforms one by one (``as_transforms``),
    so each keeps its own fusion with the unscale and its own
    ``<name>_not_finite`` diagnosis; the chain's own ``transform`` serves
    where one transform is wanted.

    Args:
      transforms: ``seams.GradientTransform`` instances, none a chain.
    """

    name = "chain"

    def __init__(self, transforms):
        self.transforms = tuple(transforms)

    @property
    def keeps_finite(self):
        """True when every transform of the chain keeps finite gradients."""
        return all(transform.keeps_finite is True for transform in self.transforms)

    def transform(self, group, grads_and_vars):
        for transform in self.transforms:
            grads_and_vars = transform.transform(group, list(grads_and_vars))
        return grads_and_vars


def chain(*transforms):
    """The transforms, in order, as one ``GradientTransform``.

    Example::

      add(loss, opt, transform_grads_fn=transforms.chain(
          my_fn, transforms.clip_by_global_norm(1.0)))

    Args:
      *transforms: ``seams.GradientTransform`` instances, functions from a
        list of (gradient, variable) pairs to a list (wrapped as
        ``add(transform_grads_fn=fn)`` wraps one), or chains.

    Returns:
      A ``Chain``.

    Raises:
      TypeError: for a value that is none of these (a transform class
        included).
    """
    for transform in transforms:
        if isinstance(transform, type):
            raise TypeError("transforms.chain() got the class %r; pass an instance, e.g. "
                            "transforms.chain(%s(...))." % (transform, transform.__name__))
        if transform is not None and not callable(transform) and not isinstance(
                transform, _seams.GradientTransform):
            raise TypeError(
                "transforms.chain() takes GradientTransform instances or functions from a "
                "list of (gradient, variable) pairs to a list, got %r. Pass e.g. "
                "transforms.clip_by_global_norm(1.0)." % (transform,))
    return Chain(part for transform in transforms for part in as_transforms(transform))


def as_transforms(value):
    """The transforms a group takes for ``value``: none for None, a chain's
    parts, a transform, a function wrapped.

    Raises:
      TypeError: as ``transform_fn.transforms_of`` (for a list too: a chain
        composes).
    """
    if isinstance(value, Chain):
        return value.transforms
    return _transform_fn.transforms_of(value)
