"""Runs ``python SCRIPT``, ``python -m MODULE`` or ``python -c CODE`` in a
process forked from one that has already imported TensorFlow and NumPy.

The suite starts many Python processes (the examples, the shim's HCCL
ranks, the parameter-server clusters, the docs' scripts), and importing
TensorFlow is most of what a short one costs. ``run`` and ``Popen`` here are
drop-ins for ``subprocess.run`` and ``subprocess.Popen`` on such commands.
Each child is a fresh process, forked from a server (``serve``, one per test
process, started on first use) that imported ``tensorflow.compat.v1`` and
``numpy`` and nothing else (no graph, no session, eager execution as TF
starts it, and not the Keras that TF imports with itself:
graph_mode.import_tensorflow), but what a test file asks it to ``preload``,
so a script sees what a fresh interpreter gives it: its own ``sys.argv``,
``sys.path`` (the script's folder, then PYTHONPATH, then the interpreter's
default), environment, working directory and ``__main__``, and its exit
status, atexit handlers and standard streams behave as in ``python SCRIPT``.

A command that is not one of those three forms, or whose environment
changes a variable TensorFlow reads when it is imported (IMPORT_TIME_ENV),
runs through ``subprocess`` as before. NPU_LOSSSCALE_TESTS_FRESH=1 sends
every command through ``subprocess``: the way to rule this module out when a
test fails in a child.
"""

import atexit
import builtins
import gc
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types

#: Variables TensorFlow reads while it is imported; a child that sets one
#: differently from this process needs a real interpreter.
IMPORT_TIME_ENV = ("TF_ENABLE_ONEDNN_OPTS", "TF_USE_LEGACY_KERAS", "CUDA_VISIBLE_DEVICES",
                   "TF_USE_MODULAR_FILESYSTEM", "PYTHONHASHSEED", "PYTHONOPTIMIZE")

PIPE = subprocess.PIPE
STDOUT = subprocess.STDOUT
DEVNULL = subprocess.DEVNULL


def _fresh():
    return os.environ.get("NPU_LOSSSCALE_TESTS_FRESH") == "1"


def _command(args):
    """(kind, target, arguments) for ``[sys.executable, SCRIPT|-m MOD|-c CODE, ...]``,
    or None for anything else."""
    args = [str(a) for a in args]
    if len(args) < 2 or args[0] != sys.executable:
        return None
    if args[1] in ("-m", "-c"):
        if len(args) < 3:
            return None
        return [args[1], args[2], args[3:]]
    if args[1].startswith("-"):
        return None
    return ["script", args[1], args[2:]]


# -- the fork server's side ------------------------------------------------------

def _exit_code(error):
    """What ``python`` exits with after ``error`` (None: the script ended)."""
    if error is None:
        return 0
    if isinstance(error, SystemExit):
        if error.code is None:
            return 0
        if isinstance(error.code, int):
            return error.code
        sys.stderr.write("%s\n" % (error.code,))
        return 1
    # The first frame is _child's own: a fresh interpreter's starts in the script.
    traceback.print_exception(type(error), error, error.__traceback__.tb_next)
    return 1


def _open_streams(request):
    """The child's stdin (always /dev/null), stdout and stderr, opened in the
    server before the fork: a FIFO's writer is then open by the time the
    client hears the pid, so its reader cannot see an early end of file."""
    opened = {}
    streams = {0: os.open(os.devnull, os.O_RDONLY)}
    for fd, path in ((1, request["out"]), (2, request["err"])):
        if path is not None:
            if path not in opened:
                opened[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            streams[fd] = opened[path]
    return streams


def _child(request, streams):
    """The forked child's body: becomes ``python`` running the request's
    command, and never returns."""
    code = 1
    try:
        kind, target, arguments = request["command"]
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, handle in streams.items():
            os.dup2(handle, fd)
        for handle in set(streams.values()):
            os.close(handle)
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        first = {"script": os.path.dirname(os.path.abspath(target)), "-m": os.getcwd(),
                 "-c": ""}[kind]
        sys.path[:] = [first] + extra + request["base_path"]
        sys.argv = ["-c" if kind == "-c" else target] + arguments
        error = None
        try:
            if kind == "script":
                runpy.run_path(target, run_name="__main__")
            elif kind == "-m":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                main = types.ModuleType("__main__")
                main.__dict__["__builtins__"] = builtins
                sys.modules["__main__"] = main
                exec(compile(target, "<string>", "exec"), main.__dict__)  # pylint: disable=exec-used
        except BaseException as caught:  # pylint: disable=broad-except
            error = caught
        code = _exit_code(error)
        threading._shutdown()  # pylint: disable=protected-access
        atexit._run_exitfuncs()  # pylint: disable=protected-access
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code)  # pylint: disable=protected-access


def _preload(modules):
    """Imports ``modules`` in the server, for every child forked after it;
    returns the reply's fields."""
    try:
        for name in modules:
            importlib.import_module(name)
    except Exception as error:  # pylint: disable=broad-except
        return {"error": "cannot preload %s: %s: %s" % (name, type(error).__name__, error)}
    gc.freeze()
    return {"preloaded": list(modules)}


def serve():
    """The fork server: imports TF and NumPy, then forks a child per request
    line on stdin and answers, on stdout, each child's pid and exit status
    (or, for a ``preload`` request, imports the modules it names)."""
    import numpy  # noqa: F401 pylint: disable=unused-import,import-outside-toplevel
    import graph_mode  # pylint: disable=import-outside-toplevel
    graph_mode.import_tensorflow()
    del sys.modules["graph_mode"]  # a child that wants it imports it afresh
    gc.freeze()  # the children's collections need not traverse TF's objects
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    requests = sys.stdin.buffer
    running = {}

    def reply(**fields):
        replies.write(json.dumps(fields) + "\n")
        replies.flush()

    reply(ready=True)
    pending = b""
    while True:
        readable = select.select([requests], [], [], 0.05)[0]
        if readable:
            chunk = os.read(requests.fileno(), 65536)
            if not chunk:  # the test process is gone: so are its children
                for pid in running:
                    os.kill(pid, signal.SIGKILL)
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line.decode("utf-8"))
                if "preload" in request:
                    reply(id=request["id"], **_preload(request["preload"]))
                    continue
                try:
                    streams = _open_streams(request)
                except OSError as error:
                    reply(id=request["id"], error="cannot open the child's streams: %s" % error)
                    continue
                pid = os.fork()
                if pid == 0:
                    replies.close()
                    _child(request, streams)
                for handle in set(streams.values()):
                    os.close(handle)
                running[pid] = request["id"]
                reply(id=request["id"], pid=pid)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            reply(id=running.pop(pid), exit=os.waitstatus_to_exitcode(status))


# -- the client's side -----------------------------------------------------------

class _Server(object):
    """The fork server this process talks to, started on first use."""

    def __init__(self):
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        base = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                              env=env, stdout=PIPE, check=True, universal_newlines=True)
        self.base_path = json.loads(base.stdout)
        self.import_env = _import_env(os.environ)
        #: The children's output files and FIFOs, removed when this process exits.
        self.root = tempfile.mkdtemp(prefix="warm-python-")
        atexit.register(shutil.rmtree, self.root, True)
        self._process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"],
                                         stdin=PIPE, stdout=PIPE, universal_newlines=True)
        self._lock = threading.Lock()
        self._next = 0
        self._children = {}
        if json.loads(self._process.stdout.readline()) != {"ready": True}:
            raise RuntimeError("the warm Python server did not start")
        reader = threading.Thread(target=self._read, name="warm-python-replies")
        reader.daemon = True
        reader.start()

    def _read(self):
        for line in self._process.stdout:
            reply = json.loads(line)
            with self._lock:
                child = self._children[reply["id"]]
            if "error" in reply:
                child["error"] = reply["error"]
                child["started"].set()
            elif "preloaded" in reply:
                child["started"].set()
            elif "pid" in reply:
                child["pid"] = reply["pid"]
                child["started"].set()
            else:
                child["exit"] = reply["exit"]
                child["done"].set()
        # The server is gone: no child of its can report, so none is left waiting.
        with self._lock:
            for child in self._children.values():
                if not child["done"].is_set():
                    child.setdefault("error", "the warm Python server exited")
                    child["exit"] = -signal.SIGKILL
                    child["started"].set()
                    child["done"].set()

    def _request(self, **fields):
        """Sends the server one request; returns its record once the server
        has answered (a child's pid, a preload's end, or an error)."""
        with self._lock:
            self._next += 1
            record = {"started": threading.Event(), "done": threading.Event(), "exit": None}
            self._children[self._next] = record
            self._process.stdin.write(json.dumps(dict(fields, id=self._next)) + "\n")
            self._process.stdin.flush()
        record["started"].wait()
        return record

    def start(self, command, env, cwd, out, err):
        """Forks a child for ``command``; returns its record (pid, events)."""
        child = self._request(command=command, env=env, cwd=cwd, out=out, err=err,
                              base_path=self.base_path)
        if "pid" not in child:
            raise RuntimeError("warm_python could not start %r: %s" % (command[:2], child["error"]))
        return child

    def preload(self, modules):
        """Has the server import ``modules`` (see ``preload``)."""
        record = self._request(preload=list(modules))
        if "error" in record:
            raise RuntimeError("warm_python: %s" % record["error"])


_SERVER = []


def _server():
    if not _SERVER:
        _SERVER.append(_Server())
    return _SERVER[0]


def _import_env(env):
    return dict((k, env.get(k)) for k in IMPORT_TIME_ENV)


def _warm(args, env):
    """Whether ``args`` can run warm: a Python command whose import-time
    variables match the server's (this process's, before the server starts,
    so that a command that runs cold never starts one)."""
    if _fresh() or _command(args) is None:
        return False
    server_env = _SERVER[0].import_env if _SERVER else _import_env(os.environ)
    return _import_env(os.environ if env is None else env) == server_env


def preload(*modules):
    """Imports ``modules`` in the fork server, so that the children forked
    after it find them imported, as they find TensorFlow.

    For the heavy modules of the scripts a test file starts many times
    (scikit-learn's in the GAN examples). A child then sees them in
    ``sys.modules`` from its start; what they do when imported happens once,
    in the server, with the server's environment. Does nothing where the
    children run fresh (NPU_LOSSSCALE_TESTS_FRESH=1).

    Raises:
      RuntimeError: a module cannot be imported.
    """
    if not _fresh():
        _server().preload(modules)


class Popen(object):
    """``subprocess.Popen`` for a Python command, forked warm when it can be
    (see the module docstring); stdout and stderr may be None, PIPE, DEVNULL,
    a file object, or (stderr) STDOUT; stdout=PIPE is readable as it runs. ``communicate``, ``wait``, ``poll``, ``kill``,
    ``terminate``, ``pid`` and ``returncode`` behave as subprocess's."""

    def __init__(self, args, stdout=None, stderr=None, env=None, cwd=None,
                 universal_newlines=None, text=None, **kwargs):
        self.args = args
        self.returncode = None
        self._text = bool(text or universal_newlines)
        self._real = None
        if kwargs or not (stdout in (None, PIPE, DEVNULL) or hasattr(stdout, "fileno")) \
                or not (stderr in (None, PIPE, DEVNULL, STDOUT) or hasattr(stderr, "fileno")) \
                or not _warm(args, env):
            self._real = subprocess.Popen(args, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                                          universal_newlines=universal_newlines, text=text,
                                          **kwargs)
            self.pid = self._real.pid
            return
        self._dir = tempfile.mkdtemp(dir=_server().root)
        self.stdout = None
        out = self._target(stdout, "stdout")
        if stdout == PIPE:
            # A FIFO, so that the caller may read stdout while the child runs.
            os.mkfifo(out)
            reader = os.open(out, os.O_RDONLY | os.O_NONBLOCK)
            os.set_blocking(reader, True)
            self.stdout = os.fdopen(reader, "r" if self._text else "rb")
        err = out if stderr == STDOUT else self._target(stderr, "stderr")
        self._stderr_path = err if stderr == PIPE else None
        self._child = _server().start(_command(args), dict(os.environ if env is None else env),
                                      os.path.abspath(cwd or os.getcwd()), out, err)
        self.pid = self._child["pid"]

    def _target(self, stream, name):
        """The path the server opens for one of the child's streams."""
        if stream == PIPE:
            return os.path.join(self._dir, name)
        if stream == DEVNULL:
            return os.devnull
        if stream is None:
            return None
        return "/proc/%d/fd/%d" % (os.getpid(), stream.fileno())

    def poll(self):
        if self._real is not None:
            self.returncode = self._real.poll()
        elif self._child["done"].is_set():
            self.returncode = self._child["exit"]
        return self.returncode

    def wait(self, timeout=None):
        if self._real is not None:
            self.returncode = self._real.wait(timeout)
            return self.returncode
        if not self._child["done"].wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.poll()

    def communicate(self, timeout=None):
        """Waits for the child; returns (stdout, stderr), each None unless PIPE."""
        if self._real is not None:
            result = self._real.communicate(timeout=timeout)
            self.returncode = self._real.returncode
            return result
        deadline = None if timeout is None else time.monotonic() + timeout
        stdout = None
        if self.stdout is not None:
            chunks = []
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not select.select([self.stdout], [], [], left)[0]:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                chunk = os.read(self.stdout.fileno(), 65536)
                if not chunk:
                    break
                chunks.append(chunk)
            self.stdout.close()
            stdout = b"".join(chunks)
            stdout = stdout.decode("utf-8", "replace") if self._text else stdout
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        stderr = None
        if self._stderr_path is not None:
            with open(self._stderr_path, "rb") as handle:
                stderr = handle.read()
            stderr = stderr.decode("utf-8", "replace") if self._text else stderr
        shutil.rmtree(self._dir, ignore_errors=True)
        return stdout, stderr

    def send_signal(self, number):
        if self._real is not None:
            self._real.send_signal(number)
        elif not self._child["done"].is_set():
            try:
                os.kill(self.pid, number)
            except ProcessLookupError:
                pass

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
        self.wait()


def run(args, capture_output=False, timeout=None, check=False, **kwargs):
    """``subprocess.run`` for a Python command, forked warm when it can be."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = PIPE
    process = Popen(args, **kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    if check and process.returncode:
        raise subprocess.CalledProcessError(process.returncode, args, stdout, stderr)
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
