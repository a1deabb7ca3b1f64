"""``add(transform_grads_fn=fn)``: TF-GAN's gradient hook, inside the decision.

``fn`` takes the group's list of (gradient, variable) pairs, unscaled, and
returns the list to apply, as TF-GAN's and slim's ``transform_grads_fn``
do. It runs at the close, after the reduction across replicas, before the
decision, so the step's overflow check covers what it returns: a step whose
transformed gradients hold an inf or a NaN skips, as an overflow does.
"""

from __future__ import absolute_import, division, print_function

import inspect

from npu_lossscale import seams as _seams


class TransformGradsFn(_seams.GradientTransform):
    """A user function as a ``seams.GradientTransform`` whose output the
    step checks (``keeps_finite`` False).

    Args:
      fn: a callable from a list of (gradient, variable) pairs to a list.
    """

    name = "transform_grads_fn"

    def __init__(self, fn):
        self.fn = fn

    def transform(self, group, grads_and_vars):
        del group
        return self.fn(list(grads_and_vars))


def transforms_of(fn):
    """The transforms of ``add(transform_grads_fn=fn)``: none for None, a
    ``seams.GradientTransform`` as it is, a function wrapped.

    Raises:
      TypeError: for a value that is neither (a transform class included).
    """
    if fn is None:
        return ()
    if isinstance(fn, _seams.GradientTransform):
        _check_signature(fn.transform, 2, "%s.transform" % fn.name,
                         "def transform(self, group, grads_and_vars)")
        return (fn,)
    if isinstance(fn, type):
        raise TypeError("transform_grads_fn=%r is a class; pass an instance or a function, "
                        "e.g. transform_grads_fn=%s()." % (fn, fn.__name__))
    if not callable(fn):
        raise TypeError(
            "transform_grads_fn must be a function from a list of (gradient, variable) "
            "pairs to a list, got %r. Pass e.g. lambda pairs: [(tf.clip_by_norm(g, 1.0), v) "
            "for g, v in pairs], or a seams.GradientTransform instance." % (fn,))
    _check_signature(fn, 1, "transform_grads_fn=%r" % (fn,),
                     "a function of one argument, the list of (gradient, variable) pairs (a "
                     "seams.GradientTransform's transform(group, grads_and_vars) takes two)")
    return (TransformGradsFn(fn),)


def _check_signature(fn, count, what, want):
    """Raises TypeError, saying ``want``, unless ``fn`` takes ``count``
    positional arguments (a callable whose signature Python cannot read
    passes)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*([None] * count))
    except TypeError as error:
        raise TypeError("%s cannot be called with %d argument%s (%s). Write %s."
                        % (what, count, "" if count == 1 else "s", error, want))
