"""`neuron models list|load|unload --url URL`: a model host's admin API from the shell.

    neuron models list --url http://127.0.0.1:8000
    neuron models load --url ... --name small --model ./ckpt [--tp 2] [--spec '{"keep_alive": 60}'] [--no-wait]
    neuron models unload --url ... small [--drain 30]

The admin key comes from --admin-key or NEURON_ADMIN_KEY. Errors are one line and exit 1 (2 for
bad arguments).
"""

from __future__ import annotations

import json
import sys

import httpx

from neuron.config import settings


def add_parser(sub) -> None:
    ap = sub.add_parser("models", help="list, load and unload the models of a running server (its admin API)",
                        description=__doc__.split("\n\n")[0])
    actions = ap.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, help in (("list", "every model the server knows, with its state"),
                       ("load", "load a model while the server runs"),
                       ("unload", "unload a model, its workers exiting and its memory given back")):
        p = actions.add_parser(name, help=help)
        p.add_argument("--url", required=True, help="the server, http://HOST:PORT (a trailing /v1 is fine)")
        p.add_argument("--admin-key", default=None, help="the server's admin key (default: NEURON_ADMIN_KEY)")
        p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the answer")
        if name == "load":
            p.add_argument("--name", required=True, help="what clients will call it")
            p.add_argument("--model", required=True, help="a checkpoint directory, cached repo id or GGUF file")
            p.add_argument("--tp", type=int, default=None)
            p.add_argument("--spec", default="{}", help="more of the spec, a JSON object (devices, dtype, keep_alive, ...)")
            p.add_argument("--no-wait", action="store_true", help="answer once the load has started")
        if name == "unload":
            p.add_argument("name")
            p.add_argument("--drain", type=float, default=0.0, help="seconds in-flight requests get to finish")
    ap.set_defaults(run=run)


def run(args) -> int:
    base = args.url.rstrip("/").removesuffix("/v1")
    key = args.admin_key or settings().admin_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=args.timeout) as client:
            if args.action == "list":
                r = client.get("/admin/models")
            elif args.action == "load":
                try:
                    spec = json.loads(args.spec)
                except json.JSONDecodeError as exc:
                    print(f"neuron models: --spec is not JSON: {exc}", file=sys.stderr)
                    return 2
                if not isinstance(spec, dict):
                    print("neuron models: --spec must be a JSON object", file=sys.stderr)
                    return 2
                spec.update(name=args.name, model=args.model, wait=not args.no_wait)
                if args.tp is not None:
                    spec["tp"] = args.tp
                r = client.post("/admin/models", json=spec)
            else:
                r = client.delete(f"/admin/models/{args.name}", params={"drain": args.drain})
    except httpx.HTTPError as exc:
        print(f"neuron models: cannot reach {base}: {exc}", file=sys.stderr)
        return 1
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text.strip() or r.reason_phrase
        print(f"neuron models: {r.status_code}: {message}", file=sys.stderr)
        return 1
    body = r.json()
    if args.action == "list":
        for m in body["data"]:
            extra = f" ({m['error']})" if m.get("error") else ""
            print(f"{m['name']}\t{m['status']}\ttp={m['tp']}\t{','.join(m['devices']) or '-'}\t"
                  f"in flight {m['in_flight']}{extra}")
    else:
        print(json.dumps(body))
    return 0
