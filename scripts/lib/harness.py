"""The check scripts' harness: one line per step, every process they start
stopped when they end (whatever way they end), and a clear message with the
processes' last log lines when a step fails."""

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

# How long a process gets to exit after SIGTERM at cleanup before SIGKILL.
STOP_GRACE = 5.0
# Log lines shown per process when a check fails.
LOG_TAIL = 25


class CheckFailed(Exception):
    """A step found a defect (or could not run); the message says which."""


class Stopped(BaseException):
    """The script itself got SIGTERM or SIGINT: clean up and exit."""


class Step:
    """One step being run; `detail` is printed after it."""

    def __init__(self, what):
        self.what, self.detail = what, ''


class Bed:
    """A temporary directory for logs and files, and the processes started in it."""

    def __init__(self, name):
        self.name = name
        self.dir = tempfile.mkdtemp(prefix=f'tether-{name}-')
        self.procs = []  # (label, Popen, log path), in start order
        self.focus = ''  # on failure, show the logs of processes whose label starts with this

    @contextlib.contextmanager
    def step(self, what):
        """Runs a step and prints `ok   <what> (<seconds>s): <detail>`, or FAIL."""
        started, current = time.monotonic(), Step(what)
        try:
            yield current
        except CheckFailed as e:
            print(f'FAIL {what} ({time.monotonic() - started:.1f}s): {e}', flush=True)
            raise
        detail = f': {current.detail}' if current.detail else ''
        print(f'ok   {what} ({time.monotonic() - started:.1f}s){detail}', flush=True)

    def path(self, *parts):
        return os.path.join(self.dir, *parts)

    def start(self, label, argv, env=None, cwd=None):
        """Starts a process with its stdout and stderr in `<label>.log`."""
        log = self.path(f'{label}.log')
        with open(log, 'ab') as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=cwd, start_new_session=True)
        self.procs.append((label, proc, log))
        return proc

    def start_with_url(self, label, argv, env=None, timeout=30.0):
        """Starts a server that prints its base URL on its first stdout line; returns it."""
        out_path, log = self.path(f'{label}.out'), self.path(f'{label}.log')
        with open(out_path, 'wb') as out, open(log, 'ab') as err:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        self.procs.append((label, proc, log))

        def first_line():
            if proc.poll() is not None:
                raise CheckFailed(f'{label} exited with status {proc.returncode}: {tail(log, 10)}')
            with open(out_path) as f:
                line = f.readline()
            return line.strip() if line.endswith('\n') else None
        return wait_until(first_line, timeout, f'{label} printing its URL')

    def stop(self, proc, sig=signal.SIGTERM, timeout=STOP_GRACE):
        """Sends `sig` to one process started here; returns (exit status or None, seconds)."""
        started = time.monotonic()
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            return proc.wait(timeout), time.monotonic() - started
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - started

    def stop_all(self):
        """Stops every process still running, newest first."""
        for _, proc, _ in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(STOP_GRACE)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def close(self, failed):
        """Stops every process still running (newest first), then removes the
        directory, or keeps it and says where when the check failed."""
        self.stop_all()
        if failed:
            for label, _, log in self.procs:
                if not label.startswith(self.focus):
                    continue
                print(f'---- {label} (last {LOG_TAIL} lines of {log})\n{tail(log, LOG_TAIL)}', file=sys.stderr)
            print(f'logs kept in {self.dir}', file=sys.stderr)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)


def tail(path, lines):
    try:
        with open(path, errors='replace') as f:
            return ''.join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return ''


def main(name, run):
    """Runs `run(bed)`, cleaning up whatever happens; exits 0 when it passed."""
    def stopped(signum, _frame):
        raise Stopped(signal.Signals(signum).name)
    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    bed, failed = Bed(name), True
    started = time.monotonic()
    try:
        run(bed)
        failed = False
    except CheckFailed as e:
        print(f'{name}: FAILED: {e}', file=sys.stderr)
    except Stopped as e:
        print(f'{name}: stopped by {e}', file=sys.stderr)
    finally:
        bed.close(failed)
    if failed:
        sys.exit(1)
    print(f'{name}: passed in {time.monotonic() - started:.0f}s')


def free_port(host='127.0.0.1'):
    family = socket.AF_INET6 if ':' in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port):
    """Whether a server could listen on `port` on every address (the pods bind
    [::] or 0.0.0.0), with SO_REUSEADDR as servers set it (so connections of a
    server that just exited, in TIME_WAIT, do not count)."""
    for family, host in ((socket.AF_INET6, '::'), (socket.AF_INET, '0.0.0.0')):
        try:
            with socket.socket(family) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
                s.listen()
                return True
        except OSError as e:
            if family == socket.AF_INET6 and e.errno == errno.EAFNOSUPPORT:  # no IPv6 here: try IPv4
                continue
            return False
    return False


def wait_until(check, timeout, what, interval=0.2):
    """Calls `check` until it returns something other than None/False; its value.
    A CheckFailed from `check` ends the wait at once."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        try:
            value = check()
            if value not in (None, False):
                return value
        except CheckFailed:
            raise
        except Exception as e:  # noqa: BLE001 - anything else is "not yet", reported at the end
            last = e
        if time.monotonic() >= deadline:
            raise CheckFailed(f'{what}: not within {timeout:g}s' + (f' (last error: {last})' if last else ''))
        time.sleep(interval)


def http(method, url, body=None, content_type='application/json', timeout=5.0):
    """(status, parsed JSON or text) of one request; never raises for an HTTP status."""
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={'Content-Type': content_type} if data is not None else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors='replace')


def run(argv, env=None, timeout=60.0, input=None, cwd=None):
    """Runs a command to completion: (exit status, stdout, stderr)."""
    try:
        done = subprocess.run(argv, env=env, input=input, capture_output=True, text=True, timeout=timeout,
                              cwd=cwd)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f'`{" ".join(argv)}` did not finish within {timeout:g}s')
    except FileNotFoundError:
        raise CheckFailed(f'{argv[0]} is not installed')
    return done.returncode, done.stdout, done.stderr
