"""Starting a rendered pod's container on this machine the way a kubelet
would: the image's ENTRYPOINT/CMD (read from the Dockerfile's last stage) with
the container's `command`/`args`, its environment (envFrom, then env, with
`$(VAR)` expansion and downward-API and ConfigMap/Secret references read from
the API server), and its ConfigMap, Secret and emptyDir volumes written as
files.

Not root-jailed, the container's filesystem is a directory here: every
mountPath is created under it, and an env value, argument or command that
points into a mountPath is rewritten to point there too."""

import base64
import json
import math
import os
import pathlib
import re
import shlex

from harness import CheckFailed, http

# The pod's address and its node's, as the downward API reports them: this machine.
POD_IP = '127.0.0.1'
NODE_NAME = 'localhost'


def image_config(dockerfile):
    """ENTRYPOINT, CMD, ENV and WORKDIR of the Dockerfile's last stage."""
    text = re.sub(r'\\\n', ' ', pathlib.Path(dockerfile).read_text())
    config = {}
    for line in text.splitlines():
        word, _, rest = line.strip().partition(' ')
        word, rest = word.upper(), rest.strip()
        if word == 'FROM':
            config = {'ENTRYPOINT': [], 'CMD': [], 'ENV': {}, 'WORKDIR': '/'}
        elif word in ('ENTRYPOINT', 'CMD'):
            if not rest.startswith('['):
                raise CheckFailed(f'{word} {rest} is the shell form: the distroless image has no shell')
            config[word] = json.loads(rest)
        elif word == 'ENV':
            pairs = shlex.split(rest)
            if pairs and '=' not in pairs[0]:  # the legacy `ENV KEY value` form
                pairs = [f'{pairs[0]}={" ".join(pairs[1:])}']
            config['ENV'].update(p.split('=', 1) for p in pairs)
        elif word == 'WORKDIR':
            config[word] = rest
    return config


def argv(container, image, binary):
    """What the container runs: `command` replaces ENTRYPOINT (and drops CMD),
    `args` replaces CMD; the image's tether is `binary` here."""
    command = container.get('command') or image['ENTRYPOINT']
    args = container['args'] if 'args' in container else ([] if container.get('command') else image['CMD'])
    if not command or os.path.basename(command[0]) != 'tether':
        raise CheckFailed(f'the container runs {command!r}, not the image\'s tether binary')
    return [binary, *command[1:], *args]


class Pod:
    """One container of a rendered pod template, made runnable here."""

    def __init__(self, api, namespace, name, template, rootfs):
        self.api, self.namespace, self.name = api, namespace, name
        self.spec, self.rootfs = template['spec'], pathlib.Path(rootfs)
        containers = self.spec.get('containers') or []
        if len(containers) != 1 or self.spec.get('initContainers'):
            raise CheckFailed(f'the pod has {len(containers)} containers and'
                              f' {len(self.spec.get("initContainers") or [])} init containers; this check runs one')
        self.container = containers[0]
        self.object = self._register(template)

    def _register(self, template):
        """Creates the Pod in the API server as the kubelet reports it: running, not restarted."""
        pod = {'apiVersion': 'v1', 'kind': 'Pod',
               'metadata': {'name': self.name, 'namespace': self.namespace,
                            'labels': (template.get('metadata') or {}).get('labels') or {},
                            'annotations': (template.get('metadata') or {}).get('annotations') or {}},
               'spec': {**self.spec, 'nodeName': NODE_NAME},
               'status': {'phase': 'Running', 'podIP': POD_IP, 'podIPs': [{'ip': POD_IP}], 'hostIP': POD_IP,
                          'containerStatuses': [{
                              'name': self.container['name'], 'image': self.container.get('image', ''),
                              'imageID': '', 'ready': False, 'started': True, 'restartCount': 0,
                              'state': {'running': {'startedAt': '2026-01-01T00:00:00Z'}}}]}}
        status, body = http('POST', f'{self.api}/api/v1/namespaces/{self.namespace}/pods', pod)
        if status not in (200, 201):
            raise CheckFailed(f'the API server refused the pod ({status}): {body}')
        return body

    def read(self, kind, name):
        """A ConfigMap's or Secret's data (decoded), as the kubelet reads it from the API server."""
        plural = {'configMap': 'configmaps', 'secret': 'secrets'}[kind]
        status, body = http('GET', f'{self.api}/api/v1/namespaces/{self.namespace}/{plural}/{name}')
        if status == 404:
            return None
        if status != 200:
            raise CheckFailed(f'reading {plural}/{name}: {status} {body}')
        data = body.get('data') or {}
        return {k: base64.b64decode(v).decode() for k, v in data.items()} if kind == 'secret' else data

    def reference(self, kind, ref):
        """The value of a configMapKeyRef or secretKeyRef (None when optional and missing)."""
        data = self.read(kind, ref['name'])
        if data is None or ref['key'] not in data:
            if ref.get('optional'):
                return None
            raise CheckFailed(f'{kind} {ref["name"]} key {ref["key"]} is missing: the kubelet would not start'
                              ' the container (CreateContainerConfigError)')
        return data[ref['key']]

    def field(self, path):
        """A downward-API fieldRef."""
        meta = self.object['metadata']
        simple = {'metadata.name': meta['name'], 'metadata.namespace': meta['namespace'],
                  'metadata.uid': meta.get('uid', ''), 'spec.nodeName': NODE_NAME,
                  'spec.serviceAccountName': self.spec.get('serviceAccountName', 'default'),
                  'status.hostIP': POD_IP, 'status.hostIPs': POD_IP, 'status.podIP': POD_IP,
                  'status.podIPs': POD_IP}
        if path in simple:
            return simple[path]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if m:
            return (meta.get(m[1]) or {}).get(m[2], '')
        raise CheckFailed(f'fieldRef {path} is not one the downward API offers')

    def resource(self, ref):
        """A resourceFieldRef, in units of its divisor (rounded up, as the kubelet does)."""
        resources = self.container.get('resources') or {}
        kind, what = ref['resource'].split('.', 1)
        value = (resources.get(kind) or {}).get(what)
        if value is None:
            raise CheckFailed(f'resourceFieldRef {ref["resource"]} is not set (a node allocatable would be used)')
        return str(math.ceil(quantity(value) / quantity(ref.get('divisor', '1'))))

    def environment(self, base):
        """The container's environment over `base`: envFrom first, then env in order."""
        env = dict(base)
        for source in self.container.get('envFrom') or []:
            kind = 'configMap' if 'configMapRef' in source else 'secret'
            ref = source.get('configMapRef') or source.get('secretRef')
            data = self.read(kind, ref['name'])
            if data is None and not ref.get('optional'):
                raise CheckFailed(f'envFrom {kind} {ref["name"]} is missing')
            env.update({source.get('prefix', '') + k: v for k, v in (data or {}).items()})
        for var in self.container.get('env') or []:
            source = var.get('valueFrom')
            if source is None:
                env[var['name']] = expand(var.get('value', ''), env)
                continue
            if 'fieldRef' in source:
                value = self.field(source['fieldRef']['fieldPath'])
            elif 'resourceFieldRef' in source:
                value = self.resource(source['resourceFieldRef'])
            elif 'configMapKeyRef' in source:
                value = self.reference('configMap', source['configMapKeyRef'])
            elif 'secretKeyRef' in source:
                value = self.reference('secret', source['secretKeyRef'])
            else:
                raise CheckFailed(f'env {var["name"]}: valueFrom {list(source)} is not emulated')
            if value is not None:
                env[var['name']] = value
        return env

    def mount_volumes(self):
        """Writes each mounted volume under the root directory; the mountPaths."""
        volumes = {v['name']: v for v in self.spec.get('volumes') or []}
        mounted = []
        for mount in self.container.get('volumeMounts') or []:
            volume = volumes.get(mount['name'])
            if volume is None:
                raise CheckFailed(f'volumeMount {mount["name"]} names no volume of the pod')
            files = self.volume_files(volume)
            target = self.rootfs / mount['mountPath'].lstrip('/')
            sub = mount.get('subPath')
            for path, content in files.items():
                if sub and path != sub and not path.startswith(sub + '/'):
                    continue
                relative = path[len(sub):].lstrip('/') if sub else path
                out = target / relative if relative else target
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(content)
            if not sub:
                target.mkdir(parents=True, exist_ok=True)
            mounted.append(mount['mountPath'])
        return mounted

    def volume_files(self, volume):
        """The files a volume holds: path inside it → content."""
        if 'emptyDir' in volume:
            return {}
        sources = (volume.get('projected') or {}).get('sources') or [volume]
        files = {}
        for source in sources:
            kind = 'configMap' if 'configMap' in source else 'secret' if 'secret' in source else None
            if kind is None:
                raise CheckFailed(f'volume {volume["name"]}: {list(source)} volumes are not emulated')
            ref = source[kind]
            data = self.read(kind, ref.get('name') or ref.get('secretName'))
            if data is None:
                if ref.get('optional'):
                    continue
                raise CheckFailed(f'volume {volume["name"]}: {kind} {ref.get("name") or ref.get("secretName")}'
                                  ' is missing: the kubelet would not start the pod')
            items = ref.get('items') or [{'key': k, 'path': k} for k in data]
            files.update({item['path']: data[item['key']] for item in items})
        return files

    def rewrite(self, value, mount_paths):
        """A path into a mountPath, moved under the root directory (the container
        would see the volume there; this process sees it here)."""
        for mount in sorted(mount_paths, key=len, reverse=True):
            if value == mount or value.startswith(mount.rstrip('/') + '/'):
                return str(self.rootfs) + value
        return value


def expand(value, env):
    """Kubernetes' `$(VAR)` expansion: defined variables are substituted, `$$` escapes."""
    return re.sub(r'\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)',
                  lambda m: '$' if m[0] == '$$' else env.get(m[1], m[0]), value)


def quantity(text):
    """A Kubernetes quantity (`100m`, `512Mi`) in its base unit."""
    m = re.fullmatch(r'([0-9.]+)([a-zA-Z]*)', str(text))
    if not m:
        raise CheckFailed(f'{text!r} is not a quantity')
    factor = {'': 1, 'm': 0.001, 'k': 1e3, 'M': 1e6, 'G': 1e9, 'T': 1e12,
              'Ki': 2**10, 'Mi': 2**20, 'Gi': 2**30, 'Ti': 2**40}.get(m[2])
    if factor is None:
        raise CheckFailed(f'unit {m[2]!r} of {text!r} is not emulated')
    return float(m[1]) * factor
