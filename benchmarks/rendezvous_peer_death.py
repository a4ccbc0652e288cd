"""How often a gloo rendezvous outlives a peer that died in it, and for how long.

Three processes form a gloo group over a TCPStore that this process serves;
the third is SIGKILLed 0-50 ms after it starts `init_process_group`. The two
others either form the group (the third was far enough), fail at once
(connection refused or closed), or stay in the rendezvous: gloo waits for
each peer it accepts a connection from without any timeout
(`Pair::waitUntilConnected`), so a peer that died after publishing its
address holds them there. A try counts as stuck when a survivor is still in
`init_process_group` `--wait` seconds after the kill.

Both sides run in one go: the group's and the store's timeouts at the
collective timeout remedy uses (30 min), and both at 8 s. A stuck try at
8 s shows that no timeout of torch's bounds the wait; that is why a
survivor's ping says `joining` while it forms a generation and the
supervisor replaces one it finds still there (`remedy.protocol.phases`).

    python benchmarks/rendezvous_peer_death.py [--tries 25] [--wait 15]
"""

from __future__ import annotations

import argparse
import datetime
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

import torch.distributed as dist

from benchmarks._smoke import add_check_imports, check_imports

CHILD = """
import datetime, sys, time
import torch.distributed as dist
port, rank, timeout_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
timeout = datetime.timedelta(seconds=timeout_s)
store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=10))
store.set_timeout(timeout)
print("start", flush=True)
try:
    dist.init_process_group("gloo", store=dist.PrefixStore(sys.argv[4], store), rank=rank,
                            world_size=3, timeout=timeout)
    print("formed", flush=True)
except Exception as exc:
    print("failed", type(exc).__name__, flush=True)
"""


def one_try(port: int, prefix: str, timeout_s: float, wait_s: float) -> str:
    """`formed`, `failed` or `stuck`: what the two survivors did."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(port), str(rank), str(timeout_s), prefix],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank in range(3)
    ]
    try:
        assert procs[2].stdout is not None
        procs[2].stdout.readline()  # "start": it is about to enter its rendezvous
        time.sleep(random.uniform(0.0, 0.05))
        procs[2].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + wait_s
        outs: list[str] = []
        for p in procs[:2]:
            try:
                out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
                outs.append(out.split()[-1] if out.split() else "?")
            except subprocess.TimeoutExpired:
                return "stuck"
        return "formed" if all(o == "formed" for o in outs) else "failed"
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=25)
    ap.add_argument("--wait", type=float, default=15.0, help="seconds after the kill")
    add_check_imports(ap)
    args = ap.parse_args()
    if args.check_imports:
        check_imports()
        return
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    print(f"{args.tries} tries per setting; a try is stuck when a survivor is still in "
          f"its rendezvous {args.wait:g} s after the kill")  # fmt: skip
    print(f"{'timeouts (group, store)':>26} {'formed':>7} {'failed':>7} {'stuck':>6}")
    n = 0
    for timeout_s in (1800.0, 8.0):
        counts = dict.fromkeys(("formed", "failed", "stuck"), 0)
        for _ in range(args.tries):
            n += 1
            counts[one_try(store.port, f"try{n}", timeout_s, args.wait)] += 1
        label = f"{timeout_s:g} s, {timeout_s:g} s"
        print(f"{label:>26} {counts['formed']:>7} {counts['failed']:>7} {counts['stuck']:>6}")


if __name__ == "__main__":
    main()
