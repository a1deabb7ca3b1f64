"""What both GAN examples share: flags, checks, devices, loss scale, layers.

The command-line checks run before TensorFlow is imported, so a bad flag
costs no TF start-up, prints exactly one line on stderr and leaves nothing
behind in ``--out``.

Runs on TF 1.15 / Python 3.7 as well as on TF 2.x through
``tensorflow.compat.v1``: layers are built from ``tf.get_variable`` and
``tf.nn`` ops only (no Keras, no ``tf.layers``).
"""

from __future__ import absolute_import, division, print_function

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
SHIMS_DIR = os.path.join(REPO_ROOT, "shims")

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
EXPONENTIAL_INCR_EVERY_N_STEPS = 1000
EXPONENTIAL_DECR_EVERY_N_NAN_OR_INF = 2
EXPONENTIAL_DECR_RATIO = 0.5

CHECKPOINT_BASENAME = "model.ckpt"


class UsageError(Exception):
    """A bad flag or environment; the message is one line."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (no usage dump), exit 2."""

    def error(self, message):
        fail(self.prog, "%s (see --help)" % message)


def fail(prog, message):
    """Prints 'prog: error: message' as one line on stderr and exits 2."""
    sys.stderr.write("%s: error: %s\n" % (prog, " ".join(str(message).split())))
    sys.stderr.flush()
    sys.exit(2)


def positive_int(text):
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected a positive integer, got %r" % (text,))
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1, got %d" % value)
    return value


def loss_scale_spec(text):
    """argparse type for --loss-scale: dynamic, exponential or fixed:N (N >= 1)."""
    if text in ("dynamic", "exponential"):
        return (text, None)
    match = re.match(r"^fixed:(.+)$", text)
    if match:
        try:
            value = float(match.group(1))
        except ValueError:
            value = None
        if value is not None and value >= 1.0 and value != float("inf"):
            return ("fixed", value)
        raise argparse.ArgumentTypeError(
            "fixed:N needs a number N >= 1 (e.g. fixed:1024), got %r" % (text,))
    raise argparse.ArgumentTypeError(
        "expected dynamic, exponential or fixed:N (e.g. fixed:1024), got %r" % (text,))


def add_common_flags(parser, steps, batch_size, log_every, out):
    """The flags both examples take, with per-example defaults."""
    parser.add_argument("--precision", choices=PRECISIONS, default="fp16",
                        help="fp16: float16 compute with float32 master weights; "
                             "fp32: float32 throughout (default: %(default)s)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="overflow check: is_finite (reads the gradients), npu "
                             "(Ascend float-status register) or auto (npu when "
                             "npu_bridge imports) (default: %(default)s)")
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
                        metavar="{dynamic,exponential,fixed:N}",
                        help="dynamic: start at 2**15, halve on overflow, double after "
                             "%d good steps; exponential: npu_bridge's rule (x0.5 after "
                             "%d overflows, x2 after %d good steps); fixed:N: constant N, "
                             "overflowing steps still skipped (default: dynamic)"
                             % (DYNAMIC_GROWTH_STEPS, EXPONENTIAL_DECR_EVERY_N_NAN_OR_INF,
                                EXPONENTIAL_INCR_EVERY_N_STEPS))
    parser.add_argument("--steps", type=positive_int, default=steps,
                        help="training steps in total, skipped ones included; with "
                             "--resume, the step to train up to (default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=batch_size,
                        help="images per step (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds TF, numpy and the metric's classifier "
                             "(default: %(default)s)")
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


# ---------------------------------------------------------------------------
# Checks that run before TensorFlow is imported.
# ---------------------------------------------------------------------------

def check_npu_bridge(args):
    """Puts shims/ on sys.path for --npu-shim; checks npu_bridge is findable.

    Raises:
      UsageError: when --device npu or --backend npu is asked for and no
        npu_bridge can be found.
    """
    if args.npu_shim:
        if not os.path.isdir(os.path.join(SHIMS_DIR, "npu_bridge")):
            raise UsageError("--npu-shim: no npu_bridge emulation under %s" % SHIMS_DIR)
        sys.path.insert(0, SHIMS_DIR)
    wanted = [flag for flag, on in (("--device npu", args.device == "npu"),
                                    ("--backend npu", args.backend == "npu")) if on]
    if wanted and importlib.util.find_spec("npu_bridge") is None:
        raise UsageError(
            "%s needs Huawei's npu_bridge (the TF Adapter of the Ascend CANN toolkit), "
            "which is not installed; install CANN and its tf_adapter, add --npu-shim to "
            "emulate it on CPU, or use --device cpu --backend is_finite"
            % " and ".join(wanted))


def latest_checkpoint(out):
    """The newest checkpoint prefix in ``out``, or None; reads no TF.

    Parses the ``checkpoint`` state file Saver writes and checks that the
    checkpoint's index file exists.
    """
    state = os.path.join(out, "checkpoint")
    if not os.path.isfile(state):
        return None
    with open(state) as handle:
        match = re.search(r'^model_checkpoint_path:\s*"(.*)"\s*$', handle.read(), re.M)
    if not match:
        return None
    prefix = match.group(1)
    if not os.path.isabs(prefix):
        prefix = os.path.join(out, prefix)
    return prefix if os.path.isfile(prefix + ".index") else None


def check_resume(args):
    """With --resume, the checkpoint to restore; raises UsageError if none."""
    if not args.resume:
        return None
    prefix = latest_checkpoint(args.out) if os.path.isdir(args.out) else None
    if prefix is None:
        raise UsageError("--resume: no checkpoint in --out %r; train without --resume "
                         "first, or point --out at a previous run" % (args.out,))
    return prefix


def check_out_dir(out):
    """Makes sure ``out`` is (or can become) a writable directory.

    Creates the directory (nothing inside it survives the probe).

    Raises:
      UsageError: if it cannot be created or written.
    """
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError("--out %r exists and is not a directory" % (out,))
    try:
        if not os.path.isdir(out):
            os.makedirs(out)
        handle, probe = tempfile.mkstemp(prefix=".write_probe_", dir=out)
        os.close(handle)
        os.remove(probe)
    except (IOError, OSError) as error:
        raise UsageError("--out %r is not writable: %s" % (
            out, getattr(error, "strerror", None) or error))


def write_json(path, payload):
    """Writes JSON through a temporary file and a rename (no half-written file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# TensorFlow, the library, devices and the session.
# ---------------------------------------------------------------------------

def tensorflow_environment(device):
    """Environment TF reads at import: quiet C++ logs; --device cpu hides GPUs.

    Call before ``import tensorflow``.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = "-1"


def graph_mode(tf):
    """TF1 graph mode (a no-op on TF 1.15), Python logs at ERROR."""
    tf.disable_eager_execution()
    tf.logging.set_verbosity(tf.logging.ERROR)


def import_npu_lossscale():
    """Imports npu_lossscale, from this checkout when it is not installed."""
    try:
        import npu_lossscale
    except ImportError:
        sys.path.insert(1, REPO_ROOT)
        import npu_lossscale
    return npu_lossscale


def load_npu_bridge(args):
    """Imports npu_bridge's ops when asked for, before the model is built.

    Importing the CPU shim installs its float-status emulation for ops built
    afterwards; importing the real adapter loads _tf_adapter.so, which
    registers the NpuOptimizer graph pass.

    Returns:
      True if npu_bridge was imported.

    Raises:
      UsageError: if it is needed and fails to import.
    """
    needed = args.device == "npu" or args.backend == "npu" or args.npu_shim
    if not needed:
        return False
    try:
        import npu_bridge
        from npu_bridge.helper import helper
        helper.get_gen_ops()
    except ImportError as error:
        if args.device == "npu" or args.backend == "npu":
            raise UsageError("npu_bridge failed to import: %s" % (error,))
        return False
    if args.device == "npu" and getattr(npu_bridge, "IS_CPU_SHIM", False):
        print("note: npu_bridge is this repository's CPU shim: the NpuOptimizer session "
              "config is built but stock TensorFlow ignores it, so this runs on the CPU")
    return True


def session_config(tf, args):
    """The ConfigProto for --device.

    * cpu: no GPU devices.
    * gpu: the visible GPUs, memory allocated as needed (allow_growth).
    * npu: the Ascend TF Adapter's documented session configuration: a
      Grappler custom optimizer named ``NpuOptimizer`` that hands the graph to
      the Ascend graph engine (``use_off_line``: run on the Ascend device, not
      on the host CPU), its ``precision_mode``, and Grappler's ``remapping``
      and ``memory_optimization`` passes OFF, as the TF Adapter docs require.
    """
    from tensorflow.core.protobuf import rewriter_config_pb2
    config = tf.ConfigProto(allow_soft_placement=True)
    if args.device == "cpu":
        config.device_count["GPU"] = 0
        # Grappler's remapper fuses MatMul + bias into oneDNN's _FusedMatMul,
        # whose float16 CPU kernel is ~40x slower than the unfused ops.
        config.graph_options.rewrite_options.remapping = rewriter_config_pb2.RewriterConfig.OFF
    elif args.device == "gpu":
        config.gpu_options.allow_growth = True
    else:
        rewrite = config.graph_options.rewrite_options
        custom_op = rewrite.custom_optimizers.add()
        custom_op.name = "NpuOptimizer"
        custom_op.parameter_map["use_off_line"].b = True
        custom_op.parameter_map["precision_mode"].s = tf.compat.as_bytes(
            npu_precision_mode(args))
        rewrite.remapping = rewriter_config_pb2.RewriterConfig.OFF
        rewrite.memory_optimization = rewriter_config_pb2.RewriterConfig.OFF
    return config


def check_gpu(tf, args):
    """Raises UsageError for --device gpu when TF sees no GPU."""
    if args.device == "gpu" and not tf.config.experimental.list_physical_devices("GPU"):
        raise UsageError("--device gpu: TensorFlow sees no GPU (is this a CUDA build of "
                         "TensorFlow with a visible device?); use --device cpu")


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
    return nl.DynamicLossScaleManager(initial_scale=INITIAL_LOSS_SCALE,
                                      growth_steps=DYNAMIC_GROWTH_STEPS)


def skipped_steps_counter(tf, is_finite):
    """A non-trainable int64 counter of skipped steps, and its increment.

    It is a global variable, so Saver checkpoints it and --resume continues
    the count.

    Returns:
      (variable, new_value): ``new_value`` adds one when ``is_finite`` is
      False and returns the count after this step.
    """
    counter = tf.get_variable("skipped_steps", [], dtype=tf.int64, trainable=False,
                              initializer=tf.zeros_initializer())
    increment = tf.cast(tf.logical_not(is_finite), tf.int64)
    return counter, tf.assign_add(counter, increment)


# ---------------------------------------------------------------------------
# Layers: float32 variables, used in the compute dtype.
# ---------------------------------------------------------------------------

def weight(tf, name, shape, dtype, stddev=0.02):
    """A float32 master weight, cast to ``dtype`` for the forward pass."""
    var = tf.get_variable(name, shape, dtype=tf.float32,
                          initializer=tf.random_normal_initializer(stddev=stddev))
    return tf.cast(var, dtype)


def bias(tf, name, shape, dtype):
    """A float32 bias, zero-initialised, cast to ``dtype``."""
    var = tf.get_variable(name, shape, dtype=tf.float32, initializer=tf.zeros_initializer())
    return tf.cast(var, dtype)


def dense(tf, x, units, name, stddev=0.02):
    """x @ W + b in x's dtype."""
    with tf.variable_scope(name):
        w = weight(tf, "w", [int(x.shape[-1]), units], x.dtype, stddev)
        return tf.matmul(x, w) + bias(tf, "b", [units], x.dtype)


def _patches_conv(tf, x, w, kernel, stride):
    """conv2d(x, w, SAME) as image patches times a matrix.

    The same arithmetic as ``tf.nn.conv2d`` (identical in float32), written
    as ``extract_patches`` + ``matmul``: stock TensorFlow's CPU kernels for
    float16 convolutions are 30-100x slower than float32 ones, while its
    float16 matmul is as fast as float32.
    """
    cin, cout = int(w.shape[2]), int(w.shape[3])
    patches = tf.image.extract_patches(x, sizes=[1, kernel, kernel, 1],
                                       strides=[1, stride, stride, 1],
                                       rates=[1, 1, 1, 1], padding="SAME")
    height, width = int(patches.shape[1]), int(patches.shape[2])
    y = tf.matmul(tf.reshape(patches, [-1, kernel * kernel * cin]),
                  tf.reshape(w, [kernel * kernel * cin, cout]))
    return tf.reshape(y, [-1, height, width, cout])


# Sub-pixel form of a kernel-4, stride-2, SAME transposed convolution: output
# pixel 2m+r takes input pixels m-1, m, m+1 through kernel taps _TAPS[.][r]
# (4 = a zero tap). From conv2d's SAME padding (1 before, 1 after):
# out[2m] = in[m-1] w[3] + in[m] w[1], out[2m+1] = in[m] w[2] + in[m+1] w[0].
_TAPS = [[3, 4], [1, 2], [4, 0]]


def _subpixel_deconv(tf, x, w):
    """conv2d_transpose(x, w, stride 2, SAME) for a 4x4 kernel, exactly.

    A 3x3 stride-1 convolution to 4 * filters channels (one group per output
    phase), then ``depth_to_space``: the arithmetic of
    ``tf.nn.conv2d_transpose``, with its products done by a matmul.
    """
    cout, cin = int(w.shape[2]), int(w.shape[3])
    padded = tf.pad(w, [[0, 1], [0, 1], [0, 0], [0, 0]])  # index 4 is zero
    taps = tf.gather(tf.gather(padded, _TAPS, axis=0), _TAPS, axis=2)
    # taps[di, r, dj, c, cout, cin] -> [di, dj, cin, (r, c, cout)]
    taps = tf.transpose(taps, [0, 2, 5, 1, 3, 4])
    kernel = tf.reshape(taps, [3, 3, cin, 4 * cout])
    return tf.depth_to_space(_patches_conv(tf, x, kernel, 3, 1), 2)


def conv(tf, x, filters, name, impl, kernel=4, stride=2):
    """A SAME convolution in x's dtype (NHWC).

    Args:
      impl: "native" (``tf.nn.conv2d``: cuDNN on GPUs, the Cube unit on
        Ascend) or "matmul" (patches + matmul: fast float16 on CPUs). Both
        use the same variables, so checkpoints move between them.
    """
    with tf.variable_scope(name):
        w = weight(tf, "w", [kernel, kernel, int(x.shape[-1]), filters], x.dtype)
        if impl == "native":
            y = tf.nn.conv2d(x, w, strides=[1, stride, stride, 1], padding="SAME")
        else:
            y = _patches_conv(tf, x, w, kernel, stride)
        return tf.nn.bias_add(y, bias(tf, "b", [filters], x.dtype))


def deconv(tf, x, filters, name, impl):
    """A 4x4, stride-2, SAME transposed convolution: doubles H and W.

    Args:
      impl: "native" (``tf.nn.conv2d_transpose``) or "matmul" (the same
        arithmetic as a sub-pixel convolution; see ``conv``).
    """
    with tf.variable_scope(name):
        height, width = int(x.shape[1]), int(x.shape[2])
        w = weight(tf, "w", [4, 4, filters, int(x.shape[-1])], x.dtype)
        if impl == "native":
            shape = tf.stack([tf.shape(x)[0], 2 * height, 2 * width, filters])
            y = tf.nn.conv2d_transpose(x, w, shape, strides=[1, 2, 2, 1], padding="SAME")
        else:
            y = _subpixel_deconv(tf, x, w)
        y = tf.reshape(y, [-1, 2 * height, 2 * width, filters])
        return tf.nn.bias_add(y, bias(tf, "b", [filters], x.dtype))


def xent(tf, logits, label):
    """Mean sigmoid cross-entropy of float32 logits against a constant label."""
    labels = tf.fill(tf.shape(logits), label)
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels,
                                                                  logits=logits))


def batch_norm(tf, x, name, epsilon=1e-5):
    """Batch normalisation over all axes but the last, computed in float32.

    Always uses the batch's statistics (the GANs only ever run with a batch),
    so there are no moving averages. Mean and variance of float16
    activations are taken in float32, the way mixed-precision recipes keep
    normalisation in float32.
    """
    with tf.variable_scope(name):
        channels = int(x.shape[-1])
        gamma = tf.get_variable("gamma", [channels], dtype=tf.float32,
                                initializer=tf.ones_initializer())
        beta = tf.get_variable("beta", [channels], dtype=tf.float32,
                               initializer=tf.zeros_initializer())
        x32 = tf.cast(x, tf.float32)
        axes = list(range(len(x.shape) - 1))
        mean, variance = tf.nn.moments(x32, axes=axes, keep_dims=True)
        y = (x32 - mean) * tf.rsqrt(variance + epsilon) * gamma + beta
        return tf.cast(y, x.dtype)
