#!/usr/bin/env python3
"""A replaying WebSocket upstream for the check scripts.

`ws://HOST:PORT/<name>?after=N` streams text messages `{"seq": N+1, ...}`,
`{"seq": N+2, ...}` at `--rate` per second; with `after` empty or absent (a
stream with no checkpoint: the worker replaces `{last_seq}` by nothing) it
starts at 0. `GET /_sessions` shows, per stream name, each session's raw
`after`, first and last sequence number sent, and whether it is still open.

`POST /stuck-sink/<name>` is an HTTP sink that reads every batch and never
answers (a worker's drain then waits for it); `GET /_stuck` counts the batches
per name. It prints its base URL (http://) on the first line of stdout.
"""

import argparse
import asyncio
import json

import aiohttp
import aiohttp.web


def start_after(after):
    """The first sequence number for a raw `after` value, None if it is not one."""
    if after in (None, ''):
        return 0
    return int(after) + 1 if after.isdigit() else None


async def serve(args):
    sessions = {}  # name → [session record]

    async def stream(request):
        name, after = request.match_info['name'], request.query.get('after')
        record = {'after': after, 'first': None, 'last': None, 'open': True}
        sessions.setdefault(name, []).append(record)
        first = start_after(after)
        if first is None:
            record['open'] = False
            return aiohttp.web.Response(status=400, text=f'after must be empty or a number, not {after!r}')
        ws = aiohttp.web.WebSocketResponse(heartbeat=None)
        await ws.prepare(request)
        seq = first
        try:
            while not ws.closed:
                await ws.send_str(json.dumps({'seq': seq, 'stream': name, 'data': f'message {seq}'}))
                record['first'] = first
                record['last'] = seq
                seq += 1
                try:  # a close frame from the worker ends the session at once
                    msg = await ws.receive(timeout=1 / args.rate)
                    if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
                        break
                except asyncio.TimeoutError:
                    pass
        except ConnectionError:
            pass
        finally:
            record['open'] = False
        return ws

    async def list_sessions(_request):
        return aiohttp.web.json_response(sessions)

    stuck = {}  # name → batches received

    async def stuck_sink(request):
        await request.read()
        name = request.match_info['name']
        stuck[name] = stuck.get(name, 0) + 1
        await asyncio.Event().wait()  # never answers; ends when the client hangs up

    async def list_stuck(_request):
        return aiohttp.web.json_response(stuck)

    app = aiohttp.web.Application()
    app.router.add_get('/_sessions', list_sessions)
    app.router.add_get('/_stuck', list_stuck)
    app.router.add_post('/stuck-sink/{name}', stuck_sink)
    app.router.add_get('/{name}', stream)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    print(f'http://{args.host}:{port}', flush=True)
    await asyncio.Event().wait()


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--host', default='127.0.0.1')
    parser.add_argument('--port', type=int, default=0)
    parser.add_argument('--rate', type=float, default=5.0, help='messages per second per session')
    asyncio.run(serve(parser.parse_args()))
