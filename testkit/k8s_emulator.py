#!/usr/bin/env python3
"""A Kubernetes API emulator for tether's controller tests, built on kmock.

kmock's KubernetesEmulator keeps objects in memory and serves list, watch,
create, patch and delete over a real HTTP port. It merges every patch as a plain
dict and keeps no resourceVersion, generation, uid or status subresource, which
a kube-rs controller relies on. This subclass adds exactly that:

- create: uid, creationTimestamp, generation 1, resourceVersion;
- patch: JSON Patch (kube's finalizer helper), merge patch and server-side
  apply bodies (approximated as a JSON merge), each bumping resourceVersion;
- spec changes bump generation; status changes only through /status;
- a merge patch carrying metadata.resourceVersion is a precondition: a
  stale one is answered 409 Conflict, as the API server does (leader election
  relies on it);
- list and watch honour equality (`k=v`) and absence (`!k`) label selectors;
- `GET /_requests` counts every request served so far by verb, resource and
  subresource (the controller's API load in the benchmark).

It prints its base URL on the first line of stdout and serves until killed.
"""

import asyncio
import copy
import datetime
import itertools
import uuid

import collections

import aiohttp.web
import attrs
import jsonpatch
from kmock._internal import apps, enums, k8s


@attrs.frozen
class Conflict(k8s.KubernetesError):
    """A stale resourceVersion precondition (HTTP 409)."""
    status: int = 409
    reason: str = 'Conflict'
    message: str = ('the object has been modified; please apply your changes'
                    ' to the latest version and try again')


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


@attrs.define(kw_only=True)
class TetherEmulator(k8s.KubernetesEmulator):
    _versions: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)

    _counts: collections.Counter = attrs.field(factory=collections.Counter, init=False)

    async def _handle(self, request):
        if request.url.path == '/_requests':
            return aiohttp.web.json_response(dict(self._counts))
        if request.resource is not None:
            watch = request.action == enums.action.WATCH
            self._counts[f"{'WATCH' if watch else request.method.value} {request.resource.plural}"
                         f"{'/' + request.subresource if request.subresource else ''}"] += 1
        # kmock matches every request against its whole request log, which
        # makes a long run quadratic: the log keeps only requests still being
        # served (all are counted above), each removed once answered.
        logged = request
        try:
            if request.resource is not None and request.action in (enums.action.CREATE, enums.action.UPDATE):
                completed = self._complete(request)
                # kmock's filters look requests up in its own log, by identity.
                self._replace_logged(request, completed)
                logged = request = completed
            return await super()._handle(request)
        finally:
            self._replace_logged(logged, None)

    def _replace_logged(self, request, replacement):
        """Replaces (or with None removes) `request` in kmock's log; it is
        recent, so the search starts from the end."""
        for i in range(len(self._requests) - 1, -1, -1):
            if self._requests[i] is request:
                if replacement is None:
                    del self._requests[i]
                else:
                    self._requests[i] = replacement
                return

    def _complete(self, request):
        version = str(next(self._versions))
        if request.action == enums.action.CREATE:
            obj = copy.deepcopy(request.data or {})
            meta = obj.setdefault('metadata', {})
            if request.namespace:
                meta.setdefault('namespace', request.namespace)
            meta.update(
                uid=str(uuid.uuid4()),
                creationTimestamp=datetime.datetime.now(tz=datetime.UTC).strftime('%Y-%m-%dT%H:%M:%SZ'),
                generation=1,
                resourceVersion=version,
            )
            return attrs.evolve(request, data=obj)
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return request  # kmock answers 404
        current = copy.deepcopy(self.objects[key].raw)
        wanted = ((request.data or {}).get('metadata') or {}).get('resourceVersion') \
            if isinstance(request.data, dict) else None
        if wanted is not None and wanted != current['metadata'].get('resourceVersion'):
            raise Conflict()
        if isinstance(request.data, list):
            patched = jsonpatch.apply_patch(current, api_server_tests(current, request.data))
        else:
            patched = merge(current, request.data or {})
        if request.subresource == 'status':
            patched = {**current, 'status': patched.get('status')}
        else:
            patched['status'] = current.get('status')
            if patched.get('spec') != current.get('spec'):
                patched['metadata']['generation'] = current['metadata'].get('generation', 1) + 1
        patched['metadata']['resourceVersion'] = version
        # kmock merges dicts and replaces lists and scalars: the full object
        # as the "patch" leaves exactly `patched` stored.
        return attrs.evolve(request, data=patched)

    async def _serve_list(self, request):
        listed = await super()._serve_list(request)
        selector = request.params.get('labelSelector')
        listed['items'] = [o for o in listed['items'] if selected(o, selector)]
        return listed

    async def _serve_watch(self, request):
        selector = request.params.get('labelSelector')
        async for event in super()._serve_watch(request):
            if not isinstance(event, dict) or selected(event.get('object') or {}, selector):
                yield event


async def main():
    emulator = TetherEmulator()
    emulator.resources['tether.dev/v1alpha1/streamconnections'].kind = 'StreamConnection'
    emulator.resources['events.k8s.io/v1/events'].kind = 'Event'
    emulator.resources['v1/secrets'].kind = 'Secret'
    emulator.resources['v1/pods'].kind = 'Pod'
    emulator.resources['coordination.k8s.io/v1/leases'].kind = 'Lease'
    async with emulator, apps.Server(emulator) as server:
        print(f'http://{server.host}:{server.port}', flush=True)
        await asyncio.Event().wait()


if __name__ == '__main__':
    asyncio.run(main())
