"""`kubetron submit|status|logs|delete`: follow TrainingJobs from a terminal (also `kubectl kubetron ...`).

The commands are kubetron.client's Client, printed. They talk to the cluster of the kubeconfig
(`--kubeconfig`, `--context`, `-n`), as kubectl does. Errors are one line on stderr: exit 2 for what no retry
fixes (a bad manifest, a spec the API server or admission rejects), 1 for the rest (a job that failed or does
not exist, logs the kubelet cannot serve).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from typing import Any

from kubetron.client import BadInput, Client, JobStatus, KubetronError, load_job
from kubetron.contract.resource import FINISHED

PROG = "kubetron"
USER_ERRORS = (400, 403, 422)  # HTTP statuses no retry fixes: exit 2


class CliError(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(" ".join(str(message).split()))
        self.code = code


def connect(args: argparse.Namespace) -> Client:
    """The client of --kubeconfig/--context/-n; a kubeconfig it cannot use, or no Kubernetes client
    installed, is exit 2."""
    try:
        return Client(namespace=args.namespace, kubeconfig=args.kubeconfig, context=args.context)
    except BadInput as exc:  # the kubeconfig: named as the option that gives it
        raise CliError(f"--{exc}", 2) from None
    except KubetronError as exc:
        raise CliError(str(exc), 2) from None


# -- status lines ---------------------------------------------------------------------------------------


def status_line(st: JobStatus) -> str:
    """`gpt: Running attempt 1 iteration 40/100 (40%) - Running: all 2 pods running`."""
    parts = [f"{st.name}: {st.phase}"]
    if st.attempt:
        parts.append(f"attempt {st.attempt}")
    if st.iteration is not None and st.train_iters:
        parts.append(f"iteration {st.iteration}/{st.train_iters} ({st.progress or ''})")
    if st.loss is not None:
        parts.append(f"loss {st.loss}")
    line = " ".join(parts)
    if st.reason:
        line += f" - {st.reason}" + (f": {st.message}" if st.message else "")
    return line


def follow(client: Client, name: str, until: tuple[str, ...], timeout: float | None,
           out: Callable[[str], None] = print) -> JobStatus:
    """Print the status line whenever it changes, until the phase is one of `until` (or a finished one)."""
    last, st = None, None
    for st in client.watch(name, timeout):
        line = status_line(st)
        if line != last:
            out(line)
            last = line
        if st.phase in until:
            return st
    assert st is not None  # watch() yields at least the status now, and ends only when the job finished
    return st


# -- commands --------------------------------------------------------------------------------------------


def submit(args: argparse.Namespace) -> int:
    body = load_job(args.file, what="FILE")
    client = connect(args)
    ns = body["metadata"].get("namespace")
    if ns and args.namespace and ns != args.namespace:
        raise CliError(f"--namespace {args.namespace} disagrees with the manifest's metadata.namespace {ns}", 2)
    created = client.create(body)
    client.namespace = created.namespace
    print(f"trainingjob {created.namespace}/{created.name} created")
    st = follow(client, created.name, FINISHED if args.wait else ("Running",), args.timeout)
    return 1 if st.phase == "Failed" else 0


def status(args: argparse.Namespace) -> int:
    client = connect(args)
    table = client.table(args.name)
    if not table.get("rows") and not args.name:
        print(f"No TrainingJobs in namespace {client.namespace}.")
        return 0
    print(format_table(table))
    return 0


def format_table(table: Mapping[str, Any]) -> str:
    """The server's columns (NAME PHASE ... AGE), plus REASON and LAST-CHECKPOINT from each object."""
    head = [c["name"].upper() for c in table["columnDefinitions"]] + ["REASON", "LAST-CHECKPOINT"]
    lines = [head]
    for row in table.get("rows") or ():
        st = (row.get("object") or {}).get("status") or {}
        ckpt = st.get("lastCheckpoint") or {}
        cells = ["<none>" if c is None or c == "" else str(c) for c in row["cells"]]
        lines.append(cells + [st.get("reason") or "<none>",
                              f"{ckpt['iteration']} ({ckpt.get('time', '')})".replace(" ()", "")
                              if ckpt.get("iteration") is not None else "<none>"])
    widths = [max(len(r[i]) for r in lines) + 3 for i in range(len(head))]
    return "\n".join("".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in lines)


def delete(args: argparse.Namespace) -> int:
    client = connect(args)
    client.delete(args.name)
    print(f"trainingjob {client.namespace}/{args.name} deleted")
    return 0


def logs(args: argparse.Namespace) -> int:
    """Each line as it comes; a closed stdout (`kubetron logs -f gpt | head`) ends the command at once, even
    while a followed pod writes nothing (its reader is a daemon thread)."""
    for line in connect(args).logs(args.name, rank=args.rank, follow=args.follow):
        sys.stdout.write(f"{line}\n")
        sys.stdout.flush()
    return 0


# -- the parser --------------------------------------------------------------------------------------


def add_commands(sub: Any, parser_class: type) -> None:
    """Add submit/status/logs/delete to the `kubetron` parser; each sets func=run(<command>)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kubeconfig", default=None, metavar="FILE",
                        help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    common.add_argument("--context", default=None, help="kubeconfig context (default: the current one)")
    common.add_argument("-n", "--namespace", default=None, metavar="NS",
                        help="namespace (default: the context's, else default)")

    p = sub.add_parser("submit", parents=[common], help="create a TrainingJob and follow it until Running",
                       description="Create the TrainingJob of FILE and print its status line whenever it changes, "
                                   "until it is Running (or with --wait, until it finished). Exit 1 if it failed.")
    p.add_argument("file", metavar="FILE", help="TrainingJob YAML manifest")
    p.add_argument("--wait", action="store_true", help="follow until Succeeded or Failed")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="give up after this long (exit 1)")
    p.set_defaults(func=run(submit))

    p = sub.add_parser("status", parents=[common], help="show TrainingJobs as kubectl get does, plus reason",
                       description="The `kubectl get trainingjobs` columns, plus the reason and last checkpoint.")
    p.add_argument("name", nargs="?", metavar="NAME", help="one job (default: all in the namespace)")
    p.set_defaults(func=run(status))

    p = sub.add_parser("logs", parents=[common], help="print the logs of the current attempt's pods",
                       description="Print the trainer logs of the current attempt's pods (each line prefixed with "
                                   "its rank when there are several).")
    p.add_argument("name", metavar="NAME")
    p.add_argument("-f", "--follow", action="store_true", help="stream the logs")
    p.add_argument("--rank", type=int, default=None, metavar="N", help="only the pod of node rank N")
    p.set_defaults(func=run(logs))

    p = sub.add_parser("delete", parents=[common], help="delete a TrainingJob (its pods go with it)")
    p.add_argument("name", metavar="NAME")
    p.set_defaults(func=run(delete))


def run(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (CliError, KubetronError) as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return exit_code(exc)
        except KeyboardInterrupt:
            return 130
    return wrapped


def exit_code(exc: CliError | KubetronError) -> int:
    """2 for what no retry fixes (bad input, a rejected request), else 1."""
    if isinstance(exc, CliError):
        return exc.code
    return 2 if isinstance(exc, BadInput) or exc.status in USER_ERRORS else 1
