"""The examples' command line: each script's flags, their checks, one-line errors.

The checks run before TensorFlow is imported, so a bad flag costs no TF
start-up, prints exactly one line on stderr and leaves nothing behind in
``--out``.
"""

from __future__ import absolute_import, division, print_function

import argparse
import contextlib
import os
import re
import sys

import numpy as np

import digits

PRECISIONS = ("fp32", "fp16")
BACKENDS = ("auto", "is_finite", "npu")
DEVICES = ("cpu", "gpu", "npu")
CONV_IMPLS = ("auto", "native", "matmul")
# Ascend operator precision modes (TF Adapter session option "precision_mode").
NPU_PRECISION_MODES = ("allow_fp32_to_fp16", "force_fp16", "force_fp32",
                       "must_keep_origin_dtype", "allow_mix_precision")
# Our fp16 graph already says which ops run in float16 (convolutions, matmuls)
# and which stay in float32 (batch-norm statistics, losses):
# allow_fp32_to_fp16 keeps that (matrix ops in float16, vector ops in their
# graph dtype when the NPU has a float32 kernel). An fp32 run asks the NPU to
# keep the graph's float32 (Atlas A2/A3 have float32 Cube kernels; on the
# Atlas training series (910A) pass --npu-precision-mode allow_fp32_to_fp16).
DEFAULT_NPU_PRECISION_MODE = {"fp16": "allow_fp32_to_fp16", "fp32": "must_keep_origin_dtype"}

# Loss-scale managers behind --loss-scale. 2**15 is Keras' initial scale and
# npu_lossscale's default. The scale grows after 1000 good steps (Keras and
# the library use 2000) so that a 2000-step demo shows it grow as well as back
# off. The exponential rule follows npu_bridge's usual
# ExponentialUpdateLossScaleManager settings (x0.5 after 2 overflows), started
# at 2**15 rather than 2**32, inside the library's 2**24 ceiling.
INITIAL_LOSS_SCALE = 2.0 ** 15
DYNAMIC_GROWTH_STEPS = 1000
# --loss-scale listening: the dynamic rule above, steered by the underflow
# measurement every this many updates (the library's default is 100; a
# shorter period lets a 2000-step demo show it react).
LISTENING_MEASURE_EVERY_N_STEPS = 50
EXPONENTIAL_INCR_EVERY_N_STEPS = 1000
EXPONENTIAL_DECR_EVERY_N_NAN_OR_INF = 2
EXPONENTIAL_DECR_RATIO = 0.5


class UsageError(Exception):
    """A bad flag or environment; the message is one line."""


@contextlib.contextmanager
def one_line_errors(prog):
    """Turns a UsageError, or a --data file that cannot be used, into
    'prog: error: ...' on one line of stderr and exit status 2."""
    try:
        yield
    except (UsageError, digits.DataError) as error:
        fail(prog, error)


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (no usage dump), exit 2."""

    def error(self, message):
        fail(self.prog, "%s (see --help)" % message)


def fail(prog, message):
    """Prints 'prog: error: message' as one line on stderr and exits 2."""
    sys.stderr.write("%s: error: %s\n" % (prog, " ".join(str(message).split())))
    sys.stderr.flush()
    sys.exit(2)


def int_in_range(low, high=None):
    """An argparse type: an int in [low, high] (no upper bound when ``high``
    is None). Its error names the valid range and the value; argparse adds
    the flag ("argument --steps: must be >= 1, got 0")."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError("expected an integer, got %r" % (text,))
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                "must be >= %d, got %d" % (low, value) if high is None
                else "must be in [%d, %d], got %d" % (low, high, value))
        return value

    parse.__name__ = "int"
    return parse


#: argparse type: an int >= 1 (step counts, intervals, sizes).
positive_int = int_in_range(1)
#: numpy's RandomState takes seeds in [0, 2**32 - 1]; dcgan.py adds small
#: offsets to the seed (seed + 1, seed + 2, per-run and per-rank offsets), so
#: half of that range is left to them.
SEED_MAX = 2 ** 31 - 1
#: The largest float32: a loss scale or learning rate above it is inf in the
#: graph.
FLOAT32_MAX = float(np.finfo(np.float32).max)
#: The largest loss scale FixedLossScaleManager takes (npu_lossscale.managers.
#: SCALE_RANGE): above 2**126 the scale's inverse is subnormal, read as 0.
FIXED_SCALE_MAX = 2.0 ** 126


def check_float(parser, args, flag, low, high=FLOAT32_MAX, low_inclusive=True):
    """Exits with a one-line argparse error naming ``flag``, its value and the
    valid range unless the value is in [low, high] (or (low, high] when not
    ``low_inclusive``); NaN is always out of range.

    Args:
      parser: the parser that read ``args`` (its ``error`` exits with status 2).
      args: the parsed namespace.
      flag: the option, e.g. "--learning-rate" (its attribute is read from ``args``).
      low: the lower bound.
      high: the upper bound (default: float32's largest value).
      low_inclusive: whether ``low`` itself is valid.
    """
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    above = value >= low if low_inclusive else value > low
    if above and value <= high:  # False for NaN too
        return
    parser.error("argument %s: must be in %s%g, %g], got %r"
                 % (flag, "[" if low_inclusive else "(", low, high, value))


def loss_scale_spec(text):
    """argparse type for --loss-scale: dynamic[:N], listening[:N], exponential
    or fixed:N (N in [1, 2**126]: the starting or the fixed scale)."""
    if text in ("dynamic", "listening", "exponential"):
        return (text, None)
    match = re.match(r"^(fixed|dynamic|listening):(.+)$", text)
    if match:
        try:
            value = float(match.group(2))
        except ValueError:
            value = None
        if value is not None and 1.0 <= value <= FIXED_SCALE_MAX:
            return (match.group(1), value)
        raise argparse.ArgumentTypeError(
            "%s:N needs a number N in [1, 2**126] (e.g. %s:1024), got %r"
            % (match.group(1), match.group(1), text))
    raise argparse.ArgumentTypeError(
        "expected dynamic, listening, exponential or fixed:N (e.g. fixed:1024), got %r"
        % (text,))


def parse_dcgan_args(prog, doc, argv):
    """dcgan.py's flags, checked (no TensorFlow needed)."""
    parser = _parser(prog, doc, steps=2000, log_every=100, out=os.path.join("runs", "dcgan"))
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --out, up to "
                             "--steps in total")
    parser.add_argument("--ckpt-every", type=positive_int, default=500,
                        help="steps between checkpoints; one is also written at the "
                             "end (default: %(default)s)")
    _add_learning_rate(parser, 5e-4, "both networks")
    parser.add_argument("--eval-samples", type=positive_int, default=1000,
                        help="generated images scored at the end (default: %(default)s)")
    parser.add_argument("--distributed", choices=("horovod",), default=None,
                        help="data-parallel training under horovodrun: every rank "
                             "trains on its own batches of --batch-size, rank 0 "
                             "writes the outputs (default: one process)")
    args = parser.parse_args(argv)
    _check_learning_rate(parser, args)
    return args


def parse_encoder_gan_args(prog, doc, argv):
    """encoder_gan.py's flags, checked (no TensorFlow needed)."""
    parser = _parser(prog, doc, steps=600, log_every=50,
                     out=os.path.join("runs", "encoder_gan"))
    parser.add_argument("--encoder-only", action="store_true",
                        help="train the autoencoder alone: no discriminator group, no "
                             "adversarial term")
    _add_learning_rate(parser, 1e-3, "both groups")
    parser.add_argument("--adversarial-weight", type=float, default=0.05,
                        help="weight of the adversarial term in the encoder's loss "
                             "(default: %(default)s)")
    args = parser.parse_args(argv)
    _check_learning_rate(parser, args)
    check_float(parser, args, "--adversarial-weight", 0.0)
    return args


def _parser(prog, doc, steps, log_every, out):
    """A parser with the flags both scripts take; its description is the
    first paragraph of the script's docstring."""
    parser = OneLineArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    add_common_flags(parser, steps=steps, batch_size=64, log_every=log_every, out=out)
    return parser


def _add_learning_rate(parser, default, what):
    parser.add_argument("--learning-rate", type=float, default=default,
                        help="Adam learning rate of %s (default: %%(default)s)" % what)


def _check_learning_rate(parser, args):
    check_float(parser, args, "--learning-rate", 0.0, low_inclusive=False)


def add_common_flags(parser, steps, batch_size, log_every, out):
    """The flags both examples take, with per-example defaults."""
    parser.add_argument("--precision", choices=PRECISIONS, default="fp16",
                        help="fp16: float16 compute with float32 master weights; "
                             "fp32: float32 throughout (default: %(default)s)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="overflow check: is_finite (reads the gradients), npu "
                             "(Ascend: the float-status register in saturation mode, "
                             "is_finite in INF/NaN mode, as npu_bridge decides) or auto "
                             "(npu when npu_bridge imports) (default: %(default)s)")
    parser.add_argument("--npu-shim", action="store_true",
                        help="put this repository's shims/ first on sys.path, so that "
                             "`import npu_bridge` loads the CPU emulation of Ascend's "
                             "float-status register")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="cpu hides GPUs; gpu uses the visible GPU (memory "
                             "growth on); npu builds the Ascend TF Adapter session "
                             "config and needs npu_bridge (default: %(default)s)")
    parser.add_argument("--npu-precision-mode", choices=NPU_PRECISION_MODES, default=None,
                        help="the NpuOptimizer's precision_mode with --device npu "
                             "(default: allow_fp32_to_fp16 for fp16, "
                             "must_keep_origin_dtype for fp32)")
    parser.add_argument("--conv", choices=CONV_IMPLS, default="auto",
                        help="how convolutions are computed: native (tf.nn.conv2d and "
                             "conv2d_transpose), matmul (image patches times a matrix, "
                             "the same arithmetic; stock TF's float16 CPU convolutions "
                             "are very slow) or auto (matmul on --device cpu, native on "
                             "gpu and npu) (default: %(default)s)")
    parser.add_argument("--loss-scale", type=loss_scale_spec, default=("dynamic", None),
                        metavar="{dynamic,listening,exponential,fixed:N}",
                        help="dynamic: start at 2**15, halve on overflow, double after "
                             "%d good steps; listening: the same, steered by an "
                             "underflow measurement every %d steps "
                             "(ListeningLossScaleManager); dynamic:N, listening:N start "
                             "at N; exponential: npu_bridge's rule (x0.5 after "
                             "%d overflows, x2 after %d good steps); fixed:N: constant N, "
                             "overflowing steps still skipped (default: dynamic)"
                             % (DYNAMIC_GROWTH_STEPS, LISTENING_MEASURE_EVERY_N_STEPS,
                                EXPONENTIAL_DECR_EVERY_N_NAN_OR_INF,
                                EXPONENTIAL_INCR_EVERY_N_STEPS))
    parser.add_argument("--steps", type=positive_int, default=steps,
                        help="training steps in total, skipped ones included; with "
                             "--resume, the step to train up to (default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=batch_size,
                        help="images per step (default: %(default)s)")
    parser.add_argument("--seed", type=int_in_range(0, SEED_MAX), default=0,
                        help="seeds TF, numpy and the metric's classifier, 0 to "
                             "2**31 - 1 (default: %(default)s)")
    parser.add_argument("--data", default=None, metavar="PATH",
                        help="a local MNIST-style .npz with an x_train array (N, H, W), "
                             "resized to 16x16 (default: scikit-learn's bundled digits)")
    parser.add_argument("--out", default=out,
                        help="directory for checkpoints, TensorBoard events and "
                             "results (default: %(default)s)")
    parser.add_argument("--log-every", type=positive_int, default=log_every,
                        help="steps between TensorBoard summaries (default: %(default)s)")


def conv_impl(args):
    """"native" or "matmul" for --conv (auto: matmul on CPU only)."""
    if args.conv != "auto":
        return args.conv
    return "matmul" if args.device == "cpu" else "native"


def npu_precision_mode(args):
    """The precision_mode for the NpuOptimizer: the flag, or the default."""
    return args.npu_precision_mode or DEFAULT_NPU_PRECISION_MODE[args.precision]


def make_manager(nl, spec):
    """The loss-scale manager for a --loss-scale spec."""
    kind, value = spec
    if kind == "fixed":
        return nl.FixedLossScaleManager(value)
    if kind == "exponential":
        return nl.ExponentialUpdateLossScaleManager(
            INITIAL_LOSS_SCALE, EXPONENTIAL_INCR_EVERY_N_STEPS,
            decr_every_n_nan_or_inf=EXPONENTIAL_DECR_EVERY_N_NAN_OR_INF,
            decr_ratio=EXPONENTIAL_DECR_RATIO)
    initial = INITIAL_LOSS_SCALE if value is None else value
    if kind == "listening":
        return nl.ListeningLossScaleManager(
            initial_scale=initial, growth_steps=DYNAMIC_GROWTH_STEPS,
            measure_every_n_steps=LISTENING_MEASURE_EVERY_N_STEPS)
    return nl.DynamicLossScaleManager(initial_scale=initial,
                                      growth_steps=DYNAMIC_GROWTH_STEPS)


def describe_loss_scale(spec):
    """--loss-scale as given: "dynamic", "fixed:1024", "listening:1"..."""
    kind, value = spec
    return kind if value is None else "%s:%g" % (kind, value)
