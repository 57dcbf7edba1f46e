"""`gpuplane token create|list|revoke|show-admin`."""

from .common import (EXIT_OK, EXIT_USAGE, TOKEN_SCOPES, CliError, ago, command, make_client, note,
                     parents, positive_int, print_json, print_table)


def add_parser(subparsers):
    conn, js, home = parents()
    tok = command(subparsers, "token", "manage API tokens (admin)", parents=(conn,))
    tsub = tok.add_subparsers(dest="token_command", metavar="TOKEN_COMMAND", required=True)
    p = command(tsub, "create", "create a token; its secret is printed once", parents=(conn, js))
    p.add_argument("--name", help="what the token is for, e.g. laptop (with --agent NODE: "
                   "'agent NODE' unless given)")
    p.add_argument("--scope", choices=TOKEN_SCOPES,
                   help="read: look only; write: submit/cancel (runs any command on every "
                        "GPU host); admin: everything; agent: use --agent NODE")
    p.add_argument("--agent", metavar="NODE",
                   help="an agent token, bound to this node name: the agent may connect as "
                        "NODE only and report only about NODE's jobs")
    p.set_defaults(func=cmd_token_create)
    p = command(tsub, "list", "list tokens (never their secrets)", parents=(conn, js))
    p.set_defaults(func=cmd_token_list)
    p = command(tsub, "revoke", "revoke a token", parents=(conn, js))
    p.add_argument("token_id", type=positive_int, metavar="ID")
    p.set_defaults(func=cmd_token_revoke)
    p = command(tsub, "show-admin", "print the admin token from the local server.toml",
                parents=(home,))
    p.set_defaults(func=cmd_token_show_admin)


def cmd_token_create(args):
    if args.agent is not None:
        if args.scope not in (None, "agent"):
            raise CliError("--agent makes an agent token; drop --scope", EXIT_USAGE)
        args.scope = "agent"
        args.name = args.name or f"agent {args.agent}"
    elif args.name is None:
        raise CliError("give the token a --name saying what it is for, e.g. --name laptop",
                       EXIT_USAGE)
    elif args.scope is None:
        raise CliError("give --scope read|write|admin, or --agent NODE for an agent",
                       EXIT_USAGE)
    elif args.scope == "agent":
        raise CliError("an agent token is bound to one node: use --agent NODE", EXIT_USAGE)
    tok = make_client(args).create_token(args.name, args.scope, node=args.agent)
    if args.json:
        print_json(tok)
        return EXIT_OK
    print(tok["token"])
    note(f"token {tok['id']} {tok['name']!r} scope {tok['scope']}: the secret above is "
         "shown only this once")
    return EXIT_OK


def cmd_token_list(args):
    tokens = make_client(args).list_tokens()
    if args.json:
        print_json(tokens)
        return EXIT_OK
    print_table([[t["id"], t.get("name"), t.get("scope"), ago(t.get("created_at")),
                  "revoked" if t.get("revoked") else "active"] for t in tokens],
                ["ID", "NAME", "SCOPE", "CREATED", "STATE"])
    return EXIT_OK


def cmd_token_revoke(args):
    answer = make_client(args).revoke_token(args.token_id)
    if args.json:
        print_json(answer)
    else:
        print(f"token {answer.get('id', args.token_id)} revoked")
    return EXIT_OK


def cmd_token_show_admin(args):
    from gpuplane.client import local_server
    _, token, path = local_server(getattr(args, "home", None))
    if not path.exists():
        raise CliError(f"{path} does not exist; start the server once (`gpuplane server` "
                       "or `gpuplane up`) to create it with an admin token, or pass --home")
    if not token:
        raise CliError(f"{path} has no admin_token; start the server once to write one")
    print(token)
    return EXIT_OK
