"""Run a function on several gloo ranks in fresh processes, with a teardown that cannot abort the test.

Why not `torch.multiprocessing.spawn(join=True)`: it fails the test on any non-zero exit code, and
gloo's teardown at interpreter exit aborts at random on a busy machine (a background thread of the
process group is still joinable when its destructor runs: "terminate called without an active
exception", SIGABRT). That abort comes after the rank has done all its work, so it says nothing
about the code under test, yet it turned CI red.

Here each rank:
1. joins the group through a rendezvous file (no TCP port to race for) with one thread for torch;
2. runs `fn(rank, world, *args)` and writes `{"result": ..., "error": traceback or None}` to its
   own file, atomically (write, then rename);
3. on success waits at a barrier (so no peer is still mid-collective), then leaves with
   `os._exit(0)`: no C++ destructors, no interpreter finalization, the kernel closes the sockets.

The parent judges each rank by the file it wrote, never by its exit code: a rank that raised
fails the test with its traceback; a rank that died before writing fails it with its exit code
(a crash in the code under test is not hidden); a run past `timeout` fails it and kills every rank.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(fn, rank: int, world: int, workdir: str, port: int, args: tuple, backend: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    result, error = None, None
    try:
        if backend == "nccl":  # one GPU a rank (NCCL refuses two ranks on one device)
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"file://{workdir}/rendezvous",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        result = fn(rank, world, *args)
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent as text
        error = traceback.format_exc()
    out = pathlib.Path(workdir) / f"rank{rank}.pt"
    torch.save({"result": result, "error": error}, str(out) + ".tmp")
    os.replace(str(out) + ".tmp", out)
    if error is None:
        try:
            dist.barrier()
        except BaseException:  # noqa: BLE001 - the result is written; a peer's failure is reported by the peer
            pass
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, world: int, *args, timeout: float = 300.0, backend: str = "gloo") -> list:
    """`[fn(0, world, *args), ..., fn(world - 1, world, *args)]`, each on its own rank (gloo, or the
    ``backend`` named: with "nccl", rank r runs on GPU r modulo the GPU count).

    `fn` must be a module-level function (the ranks are spawned, so it is pickled by name) and
    its result picklable by `torch.save`. The default process group is initialized before `fn`
    runs, and the torchrun environment variables are set (for libraries such as accelerate).
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="grpo-ranks-") as workdir:
        port = _free_port()
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world, workdir, port, args, backend), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        files = [pathlib.Path(workdir) / f"rank{r}.pt" for r in range(world)]
        deadline = time.monotonic() + timeout
        outputs: dict[int, dict] = {}
        try:
            while len(outputs) < world:
                for r, (p, f) in enumerate(zip(procs, files, strict=True)):
                    if r in outputs:
                        continue
                    if f.exists():
                        outputs[r] = torch.load(f, weights_only=False)
                        if outputs[r]["error"] is not None:  # fail at once: its peers may wait on it forever
                            raise RuntimeError(f"rank {r} of {world} raised:\n{outputs[r]['error']}")
                    elif not p.is_alive() and not f.exists():  # exists: written just before it exited
                        raise RuntimeError(
                            f"rank {r} of {world} exited with code {p.exitcode} before it wrote "
                            "its result (a crash in the code it ran)"
                        )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks ran past {timeout} s; ranks with a result: {sorted(outputs)}")
                time.sleep(0.05)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [outputs[r]["result"] for r in range(world)]
