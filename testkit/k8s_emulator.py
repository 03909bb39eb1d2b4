#!/usr/bin/env python3
"""A Kubernetes API emulator for tether's tests and for the real kubectl, built on kmock.

kmock's KubernetesEmulator keeps objects in memory and serves list, watch,
create, patch and delete over a real HTTP port, merging every write into the
stored dict. This subclass keeps kmock's object store, request parsing and
streaming, and replaces its writes, reads and discovery with what the API
server documents (https://kubernetes.io/docs/reference/using-api/api-concepts/):

Writes
- create: uid, creationTimestamp, generation 1, resourceVersion (one counter
  for the whole server), generateName; 201 Created, 409 AlreadyExists;
- patch: JSON Patch (a missing member tests as null, as kube's finalizer helper
  expects), merge patch, strategic merge patch (as a merge patch) and
  server-side apply (a merge patch, except that the fields a field manager
  applied before and leaves out now are removed); PUT replaces;
- a metadata.resourceVersion in the body is a precondition: a stale one is
  answered 409 Conflict (leader election relies on it);
- a write that changes nothing keeps the resourceVersion and sends no event;
- spec changes bump generation; a custom resource with a status subresource
  changes status only through /status (and drops it on create);
- delete: an object with finalizers gets a deletionTimestamp and stays until a
  write removes its last finalizer; then (or at once without finalizers) it
  is gone, with a DELETED event;
- dryRun=All answers as the write would, storing nothing;
- Secrets: stringData is folded into base64 data.

Custom resources, from the CRDs in crds/ (or $TETHER_EMULATOR_CRDS, a file or
a directory)
- discovery: kind, singular, shortNames, categories, scope, verbs, subresources;
- the structural schema: unknown fields are pruned and reported as
  fieldValidation asks (Strict: 400 with the API server's message; Warn, the
  default: one `Warning` header each; Ignore: silently); defaults are filled in;
- tables: `Accept: application/json;as=Table;v=v1;g=meta.k8s.io` (what
  `kubectl get` sends) gets a meta.k8s.io/v1 Table of Name plus the
  additionalPrinterColumns, each JSONPath evaluated on the object, dates shown
  as ages, priorities kept for `-o wide`;
- OpenAPI v3: /openapi/v3 and one document per group version, with each kind's
  schema and operations that take the fieldValidation parameter (so kubectl
  leaves validation to the server) and `kubectl explain` works.

Reads
- list: `<Kind>List` with the current resourceVersion, sorted by namespace and
  name; labelSelector (`k=v`, `k==v`, `k!=v`, `k`, `!k`) and fieldSelector
  (`path=v`, `path==v`, `path!=v` on a dotted path: metadata.name,
  involvedObject.uid, ...);
- watch: with resourceVersion N the events after N (410 Expired once N is
  older than the last 1,000 events of the resource); without one (or "0"), an
  ADDED event for every object first; the same selectors; timeoutSeconds ends
  the stream;
- core v1 Events are read from the events.k8s.io/v1 Events the operator
  records, converted as the API server converts them (regarding →
  involvedObject, note → message, ...), so `kubectl describe` shows them;
- `GET /_requests` counts every request served so far by verb, resource and
  subresource (the controller's API load in the benchmark).

Where it still differs from a real API server: no authentication,
authorization or admission (any token is accepted; RBAC is not checked); no
value validation (types, enums, patterns, required fields and CEL rules are
not checked, only unknown fields; an unknown fieldValidation value acts as
Warn); PUT needs no resourceVersion; namespaces need not exist, and the
namespaces resource is not served (kmock cannot route it); built-in kinds have
no schema (nothing pruned or defaulted), keep a status written with the
object, and have Name/Age tables only; server-side apply tracks one level of
ownership per field manager (no managedFields, no conflicts between
managers, lists replaced whole); strategic merge patch directives ($patch,
$retainKeys) are not understood; list ignores limit and continue (one page);
watch sends no bookmarks and ignores sendInitialEvents; no deletecollection,
no `Table` watch streams (`kubectl get -w`), no aggregated discovery (kubectl
falls back to the per-group documents) and no /openapi/v2; the CRDs are read
once at start (they are not served as apiextensions.k8s.io objects); core and
events.k8s.io Events share reads only (a core Event written is not an
events.k8s.io one) and core Events cannot be watched.

It prints its base URL on the first line of stdout and serves until killed.
"""

import asyncio
import base64
import collections
import copy
import datetime
import hashlib
import json
import os
import pathlib
import random
import re
import string
import uuid

import aiohttp.web
import attrs
import jsonpatch
import multidict
from kmock._internal import apps, enums, k8s, references

try:
    import yaml
except ImportError:  # the CRDs cannot be read: StreamConnections are served schemaless
    yaml = None

VERBS = ('create', 'delete', 'get', 'list', 'patch', 'update', 'watch')
# Watch events kept per resource for watches that resume from a resourceVersion.
EVENT_HISTORY = 1000
CORE_EVENTS = references.resource('', 'v1', 'events')
EVENTS = references.resource('events.k8s.io', 'v1', 'events')
SECRETS = references.resource('', 'v1', 'secrets')
# Built-in kinds the operator and the tests use: kind, singular, short names.
BUILTIN = {
    'v1/pods': ('Pod', 'pod', ['po']),
    'v1/secrets': ('Secret', 'secret', []),
    'v1/configmaps': ('ConfigMap', 'configmap', ['cm']),
    'v1/events': ('Event', 'event', ['ev']),
    'events.k8s.io/v1/events': ('Event', 'event', []),
    'coordination.k8s.io/v1/leases': ('Lease', 'lease', []),
}
PATCH_TYPES = ('application/json-patch+json', 'application/merge-patch+json', 'application/apply-patch+yaml')
NAME_COLUMN = {'name': 'Name', 'type': 'string', 'format': 'name', 'priority': 0,
               'description': 'Name must be unique within a namespace.'}
AGE_COLUMN = {'name': 'Age', 'type': 'date', 'jsonPath': '.metadata.creationTimestamp',
              'description': 'Custom resource definition column (in JSONPath format): .metadata.creationTimestamp'}
OBJECT_META = 'io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta'
# Core Event fields under their events.k8s.io/v1 names (the API server's conversion).
CORE_EVENT_FIELDS = {'regarding': 'involvedObject', 'note': 'message', 'deprecatedCount': 'count',
                     'deprecatedFirstTimestamp': 'firstTimestamp', 'deprecatedLastTimestamp': 'lastTimestamp',
                     'deprecatedSource': 'source', 'reportingController': 'reportingComponent'}


def api_error(status, reason, message, details=None):
    """An error answered as the API server's Status object."""
    return k8s.KubernetesError(status=status, reason=reason, message=message, details=details or {})


def noun(resource):
    """How the API server names a resource in messages: `leases.coordination.k8s.io`, `pods`."""
    return f'{resource.plural}.{resource.group}' if resource.group else resource.plural


def group_version(resource):
    return f'{resource.group}/{resource.version}' if resource.group else resource.version


def now():
    return datetime.datetime.now(tz=datetime.UTC).strftime('%Y-%m-%dT%H:%M:%SZ')


def dig(obj, dotted):
    """The value at a dotted path (`metadata.name`), None when absent."""
    for key in dotted.split('.'):
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def selected(obj, selector):
    """Whether `obj`'s labels match a selector of `k=v`, `k==v`, `k!=v`, `!k`, `k` terms."""
    labels = (obj.get('metadata') or {}).get('labels') or {}
    for term in filter(None, (t.strip() for t in (selector or '').split(','))):
        if term.startswith('!'):
            if term[1:] in labels:
                return False
        elif '!=' in term:
            k, v = term.split('!=', 1)
            if labels.get(k) == v:
                return False
        elif '=' in term:
            k, v = term.replace('==', '=').split('=', 1)
            if labels.get(k) != v:
                return False
        elif term not in labels:
            return False
    return True


def fields_match(obj, selector):
    """Whether `obj` matches a field selector of `path=v`, `path==v`, `path!=v` terms
    (an absent field reads as the empty string, as in the API server)."""
    def text(value):
        return '' if value is None else json.dumps(value) if isinstance(value, bool) else str(value)
    for term in filter(None, (t.strip() for t in (selector or '').split(','))):
        if '!=' in term:
            path, value = term.split('!=', 1)
            if text(dig(obj, path)) == value:
                return False
        else:
            path, value = term.replace('==', '=').split('=', 1)
            if text(dig(obj, path)) != value:
                return False
    return True


def merge(base, patch):
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(base) if isinstance(base, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


def leaves(obj, prefix=()):
    """The paths of an applied configuration's fields (lists and empty maps count whole)."""
    if not isinstance(obj, dict) or not obj:
        return {prefix}
    return {path for key, value in obj.items() for path in leaves(value, prefix + (key,))}


def remove(obj, path):
    """Removes the field at `path`, and the maps that removing it leaves empty."""
    if len(path) == 1:
        obj.pop(path[0], None)
    elif isinstance(obj.get(path[0]), dict):
        remove(obj[path[0]], path[1:])
        if not obj[path[0]]:
            del obj[path[0]]


def api_server_tests(doc, ops):
    """The API server's JSON Patch treats a missing member as null in `test`
    (kube's finalizer helper relies on it); python-jsonpatch does not."""
    kept = []
    for op in ops:
        if op.get('op') == 'test' and op.get('value') is None:
            try:
                jsonpatch.JsonPointer(op['path']).resolve(doc)
            except jsonpatch.JsonPointerException:
                continue  # missing == null: the test passes
        kept.append(op)
    return kept


def conform(value, schema, path, unknown, root=False):
    """A custom resource as the API server stores it under its structural schema:
    unknown fields pruned (their paths added to `unknown`), nulls of non-nullable
    fields dropped, then defaults filled in."""
    if isinstance(value, list):
        return [conform(v, schema.get('items') or {}, f'{path}[{i}]', unknown) for i, v in enumerate(value)]
    preserve = schema.get('x-kubernetes-preserve-unknown-fields')
    if not isinstance(value, dict) or (preserve and 'properties' not in schema):
        return value
    props, extra = schema.get('properties') or {}, schema.get('additionalProperties')
    out = {}
    for key, v in value.items():
        where = f'{path}.{key}' if path else key
        sub = props.get(key, extra if isinstance(extra, dict) else None)
        if sub is None:
            # apiVersion, kind and metadata are the server's own, not the schema's.
            if (root and key in ('apiVersion', 'kind', 'metadata')) or preserve or extra is True:
                out[key] = v
            else:
                unknown.append(where)
        elif v is not None or sub.get('nullable'):
            out[key] = conform(v, sub, where, unknown)
    for key, sub in props.items():
        if key not in out and 'default' in sub:
            out[key] = conform(copy.deepcopy(sub['default']), sub, key, [])
    return out


JSONPATH_STEP = re.compile(r'\.([^.\[]+)|\[([^\]]*)\]')
JSONPATH_FILTER = re.compile(r'\?\(@\.([\w.-]+)\s*(==|!=)\s*(?:"([^"]*)"|\'([^\']*)\'|([\w.-]+))\)')


def jsonpath(obj, path):
    """The values a printer column's JSONPath selects: `.field`, `[n]`, `[*]` and
    `[?(@.a.b=="v")]` steps (the subset CRDs use)."""
    values = [obj]
    for field, index in JSONPATH_STEP.findall(path.strip().strip('{}')):
        found = []
        for value in values:
            if field:
                if isinstance(value, dict) and field in value:
                    found.append(value[field])
            elif index == '*':
                found.extend(value.values() if isinstance(value, dict) else value if isinstance(value, list) else [])
            elif re.fullmatch(r'-?\d+', index):
                if isinstance(value, list) and -len(value) <= int(index) < len(value):
                    found.append(value[int(index)])
            elif (m := JSONPATH_FILTER.fullmatch(index)) and isinstance(value, list):
                wanted = next(g for g in m.group(3, 4, 5) if g is not None)
                for item in value:
                    got = dig(item, m[1])
                    got = json.dumps(got) if isinstance(got, bool) else str(got)
                    if (got == wanted) == (m[2] == '=='):
                        found.append(item)
        values = found
    return values


def human_age(timestamp):
    """An RFC 3339 time as the age the API server shows in tables (apimachinery's HumanDuration)."""
    try:
        then = datetime.datetime.fromisoformat(timestamp.replace('Z', '+00:00'))
    except (AttributeError, ValueError):
        return '<invalid>'
    s = int((datetime.datetime.now(tz=datetime.UTC) - then).total_seconds())
    if s < -1:
        return '<invalid>'
    if s < 120:
        return f'{max(s, 0)}s'
    m, h, d = s // 60, s // 3600, s // 86400
    if m < 10:
        return f'{m}m{s % 60}s' if s % 60 else f'{m}m'
    if m < 180:
        return f'{m}m'
    if h < 8:
        return f'{h}h{m % 60}m' if m % 60 else f'{h}h'
    if h < 48:
        return f'{h}h'
    if h < 192:
        return f'{d}d{h % 24}h' if h % 24 else f'{d}d'
    if d < 730:
        return f'{d}d'
    return f'{d // 365}y{d % 365}d' if d < 2920 and d % 365 else f'{d // 365}y'


def cell(column, obj):
    """One table cell: the column's JSONPath on `obj`, typed as the column says."""
    found = jsonpath(obj, column['jsonPath'])
    value = found[0] if found else None
    kind = column.get('type')
    if value is None:
        return None
    if kind == 'date':
        return human_age(value)
    if kind in ('integer', 'number'):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return int(value) if kind == 'integer' else float(value)
    if kind == 'boolean':
        return value if isinstance(value, bool) else None
    return value if isinstance(value, str) else json.dumps(value)


def wants_table(request):
    """Whether the first representation the client accepts is a meta.k8s.io Table."""
    first = request.headers.get('Accept', '').split(',')[0]
    return 'as=Table' in first and 'g=meta.k8s.io' in first


def core_event(event):
    """An events.k8s.io/v1 Event as the core v1 API shows it."""
    converted = {CORE_EVENT_FIELDS.get(k, k): v for k, v in event.items()}
    converted.update(apiVersion='v1', kind='Event')
    return converted


def load_crds(path):
    """The CustomResourceDefinitions in `path` (a YAML file or a directory of them)."""
    if yaml is None or not path.exists():
        return []
    files = sorted(path.glob('*.yaml')) if path.is_dir() else [path]
    return [doc for f in files for doc in yaml.safe_load_all(f.read_text())
            if isinstance(doc, dict) and doc.get('kind') == 'CustomResourceDefinition']


@attrs.frozen
class Custom:
    """What a CRD says about one served version of its resource."""
    kind: str
    schema: dict
    columns: list
    status_subresource: bool


@attrs.define(kw_only=True)
class TetherEmulator(k8s.KubernetesEmulator):
    _version: int = attrs.field(default=0, init=False)
    _counts: collections.Counter = attrs.field(factory=collections.Counter, init=False)
    _custom: dict = attrs.field(factory=dict, init=False)
    # Per resource: the recent watch events as (resourceVersion, event), and the
    # newest resourceVersion already dropped from them.
    _history: dict = attrs.field(factory=lambda: collections.defaultdict(
        lambda: collections.deque(maxlen=EVENT_HISTORY)), init=False)
    _dropped: collections.Counter = attrs.field(factory=collections.Counter, init=False)
    # Server-side apply: (object key, subresource, field manager) → the paths it applied last.
    _applied: dict = attrs.field(factory=dict, init=False)

    def declare(self, resource, kind, singular, namespaced=True, short_names=(), categories=(),
                subresources=()):
        info = self.resources[resource]
        info.kind, info.singular, info.namespaced = kind, singular, namespaced
        info.verbs, info.shortnames, info.categories = set(VERBS), set(short_names), set(categories)
        info.subresources = set(subresources)

    def serve_crd(self, crd):
        """Serves every version a CustomResourceDefinition serves, with its schema and columns."""
        spec, names = crd['spec'], crd['spec']['names']
        for version in spec['versions']:
            if not version.get('served', True):
                continue
            resource = references.resource(spec['group'], version['name'], names['plural'])
            subresources = list(version.get('subresources') or {})
            self.declare(resource, names['kind'], names.get('singular', names['kind'].lower()),
                         spec.get('scope') == 'Namespaced', names.get('shortNames', ()),
                         names.get('categories', ()), subresources)
            self._custom[resource] = Custom(
                kind=names['kind'], schema=(version.get('schema') or {}).get('openAPIV3Schema') or {},
                columns=version.get('additionalPrinterColumns') or [],
                status_subresource='status' in subresources)

    async def _handle(self, request):
        if request.url.path == '/_requests':
            return aiohttp.web.json_response(dict(self._counts))
        if request.url.path.startswith('/openapi/'):
            return self._serve_openapi(request)
        if request.resource is not None:
            watch = request.action == enums.action.WATCH
            self._counts[f"{'WATCH' if watch else request.method.value} {request.resource.plural}"
                         f"{'/' + request.subresource if request.subresource else ''}"] += 1
        try:
            write = self._write_for(request)
            if write is None:
                # Reads go through kmock's routing to the _serve_* methods below;
                # kmock's own write path (KubernetesEmulator._handle) is skipped.
                return await super(k8s.KubernetesEmulator, self)._handle(request)
            async with self._lock:
                body, status, warnings = await write(request)
            headers = multidict.CIMultiDict(('Warning', '299 - ' + json.dumps(w)) for w in warnings)
            return aiohttp.web.json_response(body, status=status, headers=headers)
        except k8s.KubernetesError as e:
            # Answered here: kmock would also keep every error for the end of the run.
            return await self._render_error(e)
        finally:
            # kmock matches every request against its whole request log, which
            # makes a long run quadratic: the log keeps only requests still
            # being served (all are counted above), each removed once answered.
            self._forget(request)

    def _forget(self, request):
        """Removes `request` from kmock's log; it is recent, so the search starts from the end."""
        for i in range(len(self._requests) - 1, -1, -1):
            if self._requests[i] is request:
                del self._requests[i]
                return

    async def _render_error(self, exc):
        # The API server's Status, without kmock's traceback in its details.
        if not isinstance(exc, k8s.KubernetesError):
            return await super()._render_error(exc)
        generic = isinstance(exc, k8s.KubernetesNotFoundError) and not exc.details
        return aiohttp.web.json_response({
            'kind': 'Status', 'apiVersion': 'v1', 'metadata': {}, 'status': 'Failure',
            'message': 'the server could not find the requested resource' if generic else exc.message,
            'reason': 'NotFound' if generic else exc.reason, 'details': exc.details or {}, 'code': exc.status,
        }, status=exc.status)

    # Writes: each runs under the lock, stores the object and publishes its
    # watch event, and returns (body, HTTP status, warnings).

    def _write_for(self, request):
        if request.resource is None or request.action == enums.action.WATCH:
            return None
        if request.action == enums.action.CREATE:
            return self._create
        if request.name is None:
            return None
        if request.action == enums.action.UPDATE or request.method == enums.method.PUT:
            return self._update
        if request.action == enums.action.DELETE:
            return self._delete
        return None

    async def _create(self, request):
        obj = copy.deepcopy(self._body(request))
        if not isinstance(obj, dict):
            raise api_error(400, 'BadRequest', 'the body of the request was in an unknown format')
        meta = obj.setdefault('metadata', {})
        namespace = request.namespace or meta.get('namespace')
        if meta.get('namespace', namespace) != namespace:
            raise api_error(400, 'BadRequest', 'the namespace of the provided object does not match'
                                               ' the namespace sent on the request')
        if namespace:
            meta['namespace'] = namespace
        if not meta.get('name') and meta.get('generateName'):
            meta['name'] = meta['generateName'] + ''.join(random.choices(string.ascii_lowercase + string.digits, k=5))
        if not meta.get('name'):
            raise api_error(422, 'Invalid', 'metadata.name: Required value: name or generateName is required')
        key = (request.resource, namespace, meta['name'])
        if self._current(key) is not None:
            raise api_error(409, 'AlreadyExists', f'{noun(request.resource)} "{meta["name"]}" already exists',
                            self._details(request.resource, meta['name']))
        custom = self._custom.get(request.resource)
        if custom and custom.status_subresource:
            obj.pop('status', None)
        obj, warnings = self._admit(request, obj)
        meta = obj['metadata']
        for server_set in ('deletionTimestamp', 'deletionGracePeriodSeconds'):
            meta.pop(server_set, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1,
                    resourceVersion=self._next_version())
        if not self._dry_run(request):
            self._objects[key] = obj
            await self._publish(request.resource, 'ADDED', obj)
        return obj, 201, warnings

    async def _update(self, request):
        key = (request.resource, request.namespace, request.name)
        current = self._current(key)
        if current is None:
            raise self._not_found(request)
        body = self._body(request)
        wanted = ((body.get('metadata') or {}).get('resourceVersion')) if isinstance(body, dict) else None
        if wanted is not None and wanted != current['metadata'].get('resourceVersion'):
            raise api_error(409, 'Conflict', f'Operation cannot be fulfilled on {noun(request.resource)}'
                            f' "{request.name}": the object has been modified; please apply your changes'
                            ' to the latest version and try again', self._details(request.resource, request.name))
        if request.method == enums.method.PUT:
            new = copy.deepcopy(body)
        elif isinstance(body, list):
            try:
                new = jsonpatch.apply_patch(current, api_server_tests(current, body))
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise api_error(422, 'Invalid', f'the server rejected our request due to an error in our request: {e}')
        elif 'apply-patch' in request.headers.get('Content-Type', ''):
            new = self._apply(key, request, current, body or {})
        else:
            new = merge(current, body or {})
        if not isinstance(new, dict):
            raise api_error(400, 'BadRequest', 'the body of the request was in an unknown format')
        custom = self._custom.get(request.resource)
        if request.subresource == 'status':
            new = {**{k: v for k, v in current.items() if k != 'status'},
                   **({'status': new['status']} if new.get('status') is not None else {})}
        elif custom and custom.status_subresource:
            new = {**{k: v for k, v in new.items() if k != 'status'},
                   **({'status': current['status']} if 'status' in current else {})}
        new = copy.deepcopy(new)  # a merge shares what it did not change with `current`
        # Identity and lifecycle are the server's: a body cannot change them.
        meta = new.setdefault('metadata', {})
        for field in ('name', 'namespace', 'uid', 'creationTimestamp', 'generation',
                      'deletionTimestamp', 'deletionGracePeriodSeconds', 'resourceVersion'):
            meta.pop(field, None)
            if field in current['metadata']:
                meta[field] = current['metadata'][field]
        new, warnings = self._admit(request, new)
        if {k: v for k, v in new.items() if k not in ('metadata', 'status')} != \
                {k: v for k, v in current.items() if k not in ('metadata', 'status')}:
            new['metadata']['generation'] = current['metadata'].get('generation', 1) + 1
        if new == current:
            return current, 200, warnings
        new['metadata']['resourceVersion'] = self._next_version()
        if self._dry_run(request):
            return new, 200, warnings
        if new['metadata'].get('deletionTimestamp') and not new['metadata'].get('finalizers'):
            await self._remove(key, new)
        else:
            self._objects[key] = new
            await self._publish(request.resource, 'MODIFIED', new)
        return new, 200, warnings

    async def _delete(self, request):
        key = (request.resource, request.namespace, request.name)
        current = self._current(key)
        if current is None:
            raise self._not_found(request)
        preconditions = (self._body(request) or {}).get('preconditions') or {}
        for field, value in preconditions.items():
            if value is not None and current['metadata'].get(field) != value:
                raise api_error(409, 'Conflict', f'Precondition failed: {field} in precondition: {value},'
                                f' {field} in object meta: {current["metadata"].get(field)}',
                                self._details(request.resource, request.name))
        if self._dry_run(request) or current['metadata'].get('deletionTimestamp'):
            return current, 200, []
        if current['metadata'].get('finalizers'):
            current['metadata'].update(deletionTimestamp=now(), deletionGracePeriodSeconds=0,
                                       resourceVersion=self._next_version())
            self._objects[key] = current
            await self._publish(request.resource, 'MODIFIED', current)
            return current, 200, []
        current['metadata']['resourceVersion'] = self._next_version()
        await self._remove(key, current)
        return current, 200, []

    async def _remove(self, key, last):
        del self._objects[key]
        self._applied = {k: v for k, v in self._applied.items() if k[0] != key}
        await self._publish(key[0], 'DELETED', last)

    def _apply(self, key, request, current, body):
        """Server-side apply with one level of ownership: the applied fields are
        merged in, and those this field manager applied last time but leaves out
        now are removed."""
        owner = (key, request.subresource, request.params.get('fieldManager'))
        applied = {p for p in leaves(body) if p} - {
            ('apiVersion',), ('kind',), ('metadata', 'name'), ('metadata', 'namespace'),
            ('metadata', 'resourceVersion')}
        new = copy.deepcopy(merge(current, body))
        for path in self._applied.get(owner, set()) - applied:
            remove(new, path)
        if not self._dry_run(request):
            self._applied[owner] = applied
        return new

    def _admit(self, request, obj):
        """What the server stores for `obj`, and the warnings it answers with:
        Secrets' stringData folded into data; a custom resource conformed to its
        schema, its unknown fields handled as fieldValidation asks."""
        if request.resource == SECRETS and obj.get('stringData'):
            data = obj.get('data') or {}
            for k, v in obj.pop('stringData').items():
                data[k] = base64.b64encode(str(v).encode()).decode()
            obj['data'] = data
        custom = self._custom.get(request.resource)
        if custom is None:
            return obj, []
        unknown = []
        obj = conform(obj, custom.schema, '', unknown, root=True)
        mode = request.params.get('fieldValidation') or 'Warn'
        if unknown and 'apply-patch' in request.headers.get('Content-Type', ''):
            # Server-side apply refuses fields outside the schema whatever fieldValidation says.
            raise api_error(500, 'InternalError', f'failed to create typed patch object'
                            f' ({group_version(request.resource)}, Kind={custom.kind}): .{unknown[0]}:'
                            ' field not declared in schema')
        if unknown and mode == 'Strict':
            raise api_error(400, 'BadRequest', f'{custom.kind} in version "{request.resource.version}" cannot'
                            f' be handled as a {custom.kind}: strict decoding error: '
                            + ', '.join(f'unknown field "{path}"' for path in unknown))
        return obj, [] if mode == 'Ignore' else [f'unknown field "{path}"' for path in unknown]

    async def _publish(self, resource, kind, obj):
        event = {'type': kind, 'object': obj}
        history = self._history[resource]
        if len(history) == history.maxlen:
            self._dropped[resource] = history[0][0]
        history.append((int(obj['metadata']['resourceVersion']), event))
        await self._buses[resource].put(event)

    def _next_version(self):
        self._version += 1
        return str(self._version)

    @staticmethod
    def _dry_run(request):
        return request.params.get('dryRun') == 'All'

    @staticmethod
    def _body(request):
        """The request's object: JSON, or the YAML a server-side apply may send."""
        if request.data is not None or not request.text.strip() or yaml is None:
            return request.data
        try:
            return yaml.safe_load(request.text)
        except yaml.YAMLError as e:
            raise api_error(400, 'BadRequest', f'error decoding YAML: {e}')

    @staticmethod
    def _details(resource, name):
        return {'name': name, 'group': resource.group, 'kind': resource.plural}

    def _not_found(self, request):
        return api_error(404, 'NotFound', f'{noun(request.resource)} "{request.name}" not found',
                         self._details(request.resource, request.name))

    # Reads.

    def _current(self, key):
        """A copy of the object stored at `key`, None if there is none."""
        return copy.deepcopy(self._objects[key].raw) if key in self._objects else None

    def _stored(self, resource, namespace=None):
        """The objects of `resource` (in `namespace`, or in all), by namespace and name;
        core Events include the events.k8s.io ones, converted."""
        found = [obj.raw for (r, ns, _), obj in self._objects.items()
                 if r == resource and (namespace is None or ns == namespace)]
        if resource == CORE_EVENTS:
            found += [core_event(e) for e in self._stored(EVENTS, namespace)]
        return sorted(found, key=lambda o: ((o['metadata'].get('namespace') or ''), o['metadata'].get('name') or ''))

    def _matches(self, request, obj):
        meta = obj.get('metadata') or {}
        return ((request.namespace is None or meta.get('namespace') == request.namespace)
                and (request.name is None or meta.get('name') == request.name)
                and selected(obj, request.params.get('labelSelector'))
                and fields_match(obj, request.params.get('fieldSelector')))

    async def _serve_list(self, request):
        if not any(r == request.resource for r in self._get_resources()):
            raise k8s.KubernetesResourceNotFoundError()
        items = [o for o in self._stored(request.resource, request.namespace) if self._matches(request, o)]
        version = str(self._version)
        if wants_table(request):
            return self._table(request, items, version)
        kind = self.resources[request.resource].kind or request.resource.plural.capitalize()
        return {'apiVersion': group_version(request.resource), 'kind': f'{kind}List',
                'metadata': {'resourceVersion': version}, 'items': items}

    async def _serve_fetch(self, request):
        if request.resource == CORE_EVENTS:
            found = [o for o in self._stored(request.resource, request.namespace)
                     if o['metadata'].get('name') == request.name]
        else:
            key = (request.resource, request.namespace, request.name)
            found = [self._objects[key].raw] if key in self._objects else []
        if not found:
            raise self._not_found(request)
        return self._table(request, found, str(self._version)) if wants_table(request) else found[0]

    async def _serve_watch(self, request):
        yield b''  # kmock sends the response headers with the first chunk
        since = request.params.get('resourceVersion') or '0'
        timeout = float(request.params.get('timeoutSeconds') or 0) or None
        bus = self._buses[request.resource]
        async with self._lock:  # no write between the backlog and the live events
            mark = await bus.mark()
            if since == '0':
                backlog = [{'type': 'ADDED', 'object': o} for o in self._stored(request.resource)]
            elif not since.isdigit() or int(since) < self._dropped[request.resource]:
                backlog = [{'type': 'ERROR', 'object': {
                    'kind': 'Status', 'apiVersion': 'v1', 'metadata': {}, 'status': 'Failure', 'code': 410,
                    'reason': 'Expired', 'message': f'too old resource version: {since} ({self._version})'}}]
            else:
                backlog = [event for version, event in self._history[request.resource] if version > int(since)]
        live = None
        try:
            for event in backlog:
                if event['type'] == 'ERROR':
                    yield event
                    return
                if self._matches(request, event['object']):
                    yield event
            live = bus.stream(since=mark)
            deadline = asyncio.get_running_loop().time() + timeout if timeout else None
            while True:
                left = deadline - asyncio.get_running_loop().time() if deadline else None
                if left is not None and left <= 0:
                    return  # timeoutSeconds: the server ends the watch
                try:
                    event = await asyncio.wait_for(anext(live), left)
                except TimeoutError:
                    return
                if self._matches(request, event['object']):
                    yield event
        finally:
            if live is not None:
                await live.aclose()
            await bus.unmark(mark)

    def _table(self, request, objs, version):
        """A meta.k8s.io/v1 Table of `objs`: Name, then the CRD's printer columns (or Age)."""
        custom = self._custom.get(request.resource)
        columns = (custom.columns if custom else None) or [AGE_COLUMN]
        include = request.params.get('includeObject') or 'Metadata'
        rows = []
        for obj in objs:
            row = {'cells': [obj['metadata'].get('name')] + [cell(c, obj) for c in columns]}
            if include == 'Object':
                row['object'] = obj
            elif include != 'None':
                row['object'] = {'kind': 'PartialObjectMetadata', 'apiVersion': 'meta.k8s.io/v1',
                                 'metadata': obj['metadata']}
            rows.append(row)
        return {'kind': 'Table', 'apiVersion': 'meta.k8s.io/v1', 'metadata': {'resourceVersion': version},
                'columnDefinitions': [NAME_COLUMN] + [
                    {'name': c['name'], 'type': c['type'], 'format': c.get('format', ''),
                     'description': c.get('description', ''), 'priority': c.get('priority', 0)}
                    for c in columns],
                'rows': rows}

    # Discovery and OpenAPI.

    async def _serve_version(self, request):
        # kmock's, with the core group's groupVersion ("v1"), scope, verbs and
        # each subresource's own verbs.
        resources = sorted((r for r in self._get_resources() if request.resource.check(r)),
                           key=lambda r: r.plural)
        if not resources and request.resource.group != '':
            raise k8s.KubernetesResourceNotFoundError()
        entries = []
        for resource in resources:
            info = self.resources[resource]
            entry = {'name': resource.plural, 'singularName': info.singular or '',
                     'namespaced': info.namespaced is not False,
                     'kind': info.kind or resource.plural.capitalize(), 'verbs': sorted(info.verbs or VERBS)}
            if info.shortnames:
                entry['shortNames'] = sorted(info.shortnames)
            if info.categories:
                entry['categories'] = sorted(info.categories)
            entries.append(entry)
            entries += [{'name': f'{resource.plural}/{sub}', 'singularName': '', 'namespaced': entry['namespaced'],
                         'kind': entry['kind'], 'verbs': ['get', 'patch', 'update']}
                        for sub in sorted(info.subresources)]
        return {'kind': 'APIResourceList', 'apiVersion': 'v1',
                'groupVersion': group_version(request.resource), 'resources': entries}

    def _serve_openapi(self, request):
        """/openapi/v3 lists one document per group version, which its own path serves."""
        documents = self._openapi_documents()
        path = request.url.path.removeprefix('/openapi/v3').strip('/')
        if request.url.path.rstrip('/') == '/openapi/v3':
            return aiohttp.web.json_response({'paths': {
                gv: {'serverRelativeURL': f'/openapi/v3/{gv}?hash='
                                          + hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest().upper()}
                for gv, doc in documents.items()}})
        if request.url.path.startswith('/openapi/v3/') and path in documents:
            return aiohttp.web.json_response(documents[path])
        raise k8s.KubernetesNotFoundError()

    def _openapi_documents(self):
        """One OpenAPI 3 document per group version: the paths of each resource,
        whose writes take fieldValidation (kubectl then validates on the server),
        and each kind's schema, tagged with its group, version and kind (what
        `kubectl explain` looks up)."""
        documents = {}
        for resource in self._get_resources():
            info, custom = self.resources[resource], self._custom.get(resource)
            prefix = f'apis/{resource.group}/{resource.version}' if resource.group else f'api/{resource.version}'
            doc = documents.setdefault(prefix, {
                'openapi': '3.0.0', 'info': {'title': 'Kubernetes', 'version': 'unversioned'}, 'paths': {},
                'components': {'schemas': {OBJECT_META: {
                    'type': 'object', 'description': 'ObjectMeta is metadata that all persisted resources must have.',
                    'properties': {f: {'type': 'string'} for f in ('name', 'namespace', 'generateName', 'uid',
                                                                  'resourceVersion', 'creationTimestamp')}
                    | {'labels': {'type': 'object', 'additionalProperties': {'type': 'string'}},
                       'annotations': {'type': 'object', 'additionalProperties': {'type': 'string'}},
                       'finalizers': {'type': 'array', 'items': {'type': 'string'}}}}}}})
            kind = info.kind or resource.plural.capitalize()
            gvk = {'group': resource.group, 'version': resource.version, 'kind': kind}
            reverse = '.'.join(reversed(resource.group.split('.'))) if resource.group else 'io.k8s.api.core'
            name = f'{reverse}.{resource.version}.{kind}'
            schema = copy.deepcopy(custom.schema) if custom else {
                'type': 'object', 'x-kubernetes-preserve-unknown-fields': True,
                'description': f'{kind} (the emulator has no schema for built-in kinds).'}
            schema.setdefault('properties', {}).update({
                'apiVersion': {'type': 'string', 'description': 'The versioned schema of this representation.'},
                'kind': {'type': 'string', 'description': 'The REST resource this object represents.'},
                'metadata': {'description': "Standard object's metadata.",
                             'allOf': [{'$ref': f'#/components/schemas/{OBJECT_META}'}]}})
            doc['components']['schemas'][name] = schema | {'x-kubernetes-group-version-kind': [gvk]}
            ref = {'$ref': f'#/components/schemas/{name}'}

            def operation(action, body_types=()):
                op = {'x-kubernetes-action': action, 'x-kubernetes-group-version-kind': gvk,
                      'responses': {'200': {'description': 'OK', 'content': {'application/json': {'schema': ref}}}}}
                if body_types:
                    op['parameters'] = [{'name': 'fieldValidation', 'in': 'query', 'schema': {'type': 'string'},
                                         'description': 'Ignore, Warn or Strict: what to do with unknown fields.'}]
                    op['requestBody'] = {'content': {t: {'schema': ref} for t in body_types}}
                return op
            scope = '/namespaces/{namespace}' if info.namespaced is not False else ''
            collection = f'/{prefix}{scope}/{resource.plural}'
            doc['paths'][collection] = {'get': operation('list'), 'post': operation('post', ['application/json'])}
            for item in [f'{collection}/{{name}}'] + [f'{collection}/{{name}}/{s}' for s in sorted(info.subresources)]:
                doc['paths'][item] = {'get': operation('get'), 'put': operation('put', ['application/json']),
                                      'patch': operation('patch', PATCH_TYPES)}
            doc['paths'][f'{collection}/{{name}}']['delete'] = operation('delete')
        return documents


async def main():
    emulator = TetherEmulator()
    for resource, (kind, singular, short_names) in BUILTIN.items():
        emulator.declare(resource, kind, singular, short_names=short_names)
    crds = pathlib.Path(os.environ.get('TETHER_EMULATOR_CRDS')
                        or pathlib.Path(__file__).resolve().parent.parent / 'crds')
    for crd in load_crds(crds):
        emulator.serve_crd(crd)
    if not emulator._custom:  # no CRD readable (no PyYAML?): StreamConnections without a schema
        emulator.declare('tether.dev/v1alpha1/streamconnections', 'StreamConnection', 'streamconnection')
    async with emulator, apps.Server(emulator) as server:
        print(f'http://{server.host}:{server.port}', flush=True)
        await asyncio.Event().wait()


if __name__ == '__main__':
    asyncio.run(main())
