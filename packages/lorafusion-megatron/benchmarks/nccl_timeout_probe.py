"""Does NCCL's own timeout end a wait on a peer that never comes? One probe per kind of wait, 2 GPUs.

Run on a host with 2 GPUs (from the repository root)::

    python packages/lorafusion-megatron/benchmarks/nccl_timeout_probe.py --out results/probe.json

Each probe starts two processes on one NCCL process group whose timeout is ``--timeout`` seconds.
Rank 1 sleeps through the ``--window`` seconds (and 15 more) and takes part in nothing; rank 0
waits for it in one way:

- ``all_reduce``: a collective (the control: torch's NCCL watchdog times these out);
- ``recv``: ``dist.recv`` from rank 1;
- ``batch_recv``: ``dist.batch_isend_irecv`` of one ``irecv``, then ``wait()``;
- ``batch_exchange``: as the pipeline's exchange (``pipeline/p2p.py``): an ``isend`` and an
  ``irecv`` of a header and a payload in one ``batch_isend_irecv``, ``wait()``, then the header read
  on the host.

Rank 0 synchronises the GPU after the wait, so a wait that returns at once still blocks there.
With ``--warm`` the two ranks first exchange one tensor point to point. For each probe: whether
and when rank 0 ended within the window, its exit code, and the lines of its output that name a
timeout or the watchdog. Environment variables of torch's NCCL watchdog (``TORCH_NCCL_*``) pass
through; ``--env`` adds some for every probe.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROBES = ("all_reduce", "recv", "batch_recv", "batch_exchange")


def rank_main(rank: int, probe: str, timeout: float, window: float, warm: bool) -> None:
    """One rank of one probe: rank 1 sleeps through the window, rank 0 waits for it as ``probe`` says.

    With ``warm``, the ranks first exchange one tensor point to point (so NCCL's communicator for
    the pair exists before the wait, as it does after a pipeline's first exchange).
    """
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=timeout), device_id=device)
    dist.barrier()
    print(f"rank {rank}: process group up", flush=True)
    if warm:
        first = torch.zeros(16, device=device)
        ops = [dist.P2POp(dist.isend, first, 1 - rank), dist.P2POp(dist.irecv, first.clone(), 1 - rank)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        torch.cuda.synchronize(device)
        print(f"rank {rank}: one exchange done", flush=True)
    if rank == 1:
        time.sleep(window + 60)  # killed at the end of the window: it never leaves while rank 0 waits
        os._exit(0)
    start = time.monotonic()
    header = torch.zeros(2, dtype=torch.int64, device=device)
    payload = torch.zeros(1024, 4096, dtype=torch.bfloat16, device=device)
    if probe == "all_reduce":
        dist.all_reduce(payload)
    elif probe == "recv":
        dist.recv(payload, src=1)
    elif probe == "batch_recv":
        for request in dist.batch_isend_irecv([dist.P2POp(dist.irecv, payload, 1)]):
            request.wait()
    else:
        ops = [
            dist.P2POp(dist.isend, header, 1),
            dist.P2POp(dist.isend, payload, 1),
            dist.P2POp(dist.irecv, header.clone(), 1),
            dist.P2POp(dist.irecv, payload.clone(), 1),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        ops[2].tensor.tolist()
    torch.cuda.synchronize(device)
    print(f"rank 0: the wait returned after {time.monotonic() - start:.1f} s", flush=True)


def run_probe(
    probe: str, timeout: float, window: float, warm: bool, port: int, env: dict[str, str], logs: Path
) -> dict[str, object]:
    """Start both ranks of one probe; rank 0's fate within the window (each rank is killed after it)."""
    base = {**os.environ, **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    procs = []
    for rank in range(2):
        command = [sys.executable, __file__, "--rank", str(rank), "--probe", probe, "--timeout", str(timeout)]
        command += ["--window", str(window)] + (["--warm"] if warm else [])
        with (logs / f"{probe}-rank{rank}.log").open("w") as log:
            procs.append(
                subprocess.Popen(command, env={**base, "RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT)
            )
    start = time.monotonic()
    ended_at: float | None = None
    while time.monotonic() - start < window + 15:
        if procs[0].poll() is not None:
            ended_at = time.monotonic() - start
            break
        time.sleep(0.5)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    lines = (logs / f"{probe}-rank0.log").read_text(errors="replace").splitlines()
    said = [
        line[:300] for line in lines if any(w in line.lower() for w in ("timeout", "timed out", "watchdog", "returned"))
    ]
    result = {"probe": probe, "rank0_ended_s": None if ended_at is None else round(ended_at, 1)}
    result |= {"rank0_exit_code": procs[0].returncode if ended_at is not None else None, "rank0_said": said[:8]}
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    """Parse arguments; as a rank, run it; else run every probe and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe", choices=PROBES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probes", nargs="+", choices=PROBES, default=list(PROBES))
    parser.add_argument("--timeout", type=float, default=20.0, help="the process group's timeout, seconds")
    parser.add_argument("--window", type=float, default=60.0, help="how long rank 0 is watched (plus 15 s), seconds")
    parser.add_argument("--warm", action="store_true", help="one point-to-point exchange before the wait")
    parser.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE", help="set for every probe")
    parser.add_argument("--first-port", type=int, default=29500, help="the probes' rendezvous ports count up from it")
    parser.add_argument("--out", type=Path, default=Path("nccl_timeout_probe.json"))
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.probe, args.timeout, args.window, args.warm)
        return
    import torch

    env = dict(item.split("=", 1) for item in args.env)
    logs = args.out.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    results = [
        run_probe(probe, args.timeout, args.window, args.warm, args.first_port + i, env, logs)
        for i, probe in enumerate(args.probes)
    ]
    record = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(0),
        "versions": {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))},
        "timeout_s": args.timeout, "window_s": args.window, "warm": args.warm, "env": env,
        "torch_nccl_env": {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL", "NCCL_"))},
        "results": results,
    }  # fmt: skip
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
