"""PyTorch on nccl-rs (scripts/device-check.sh, step b): two processes on cuda:0.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... LD_PRELOAD=libnccl.so.2 python3 torch_check.py nccl
    RANK=r ... python3 torch_check.py gloo        # the same DDP steps on the gloo backend
    python3 torch_check.py compare                 # DDP losses of both must be equal
    RANK=r ... python3 torch_check.py selftest    # the checks themselves, on gloo and the CPU
                                                   # (what gloo supports), before a GPU run
    RANK=r ... LD_PRELOAD=... python3 torch_check.py stress   # direct all-reduces while another
                                                   # thread calls torch.cuda.empty_cache()
    RANK=r ... NCCL_RS_GRAPH_CAPTURE=1 LD_PRELOAD=... python3 torch_check.py graph   # collectives
                                                   # captured by torch.cuda.graph, replayed

Collectives are checked exactly (inputs are small integers, exact in fp32 and bf16 sums).
"""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

OUT = os.path.dirname(os.path.abspath(__file__))


def ran(name, fn):
    """Runs fn; True if it ran. On the CPU (selftest), an operation gloo lacks is reported and
    skipped (False); with any other backend a failure is an error."""
    try:
        fn()
        return True
    except (RuntimeError, NotImplementedError, ValueError) as e:
        if dist.get_backend() != "gloo":
            raise
        print(f"rank {dist.get_rank()}: {name}: skipped on gloo ({str(e).splitlines()[0][:80]})", flush=True)
        return False


def check(name, got, want):
    ok = torch.equal(got.float().cpu(), want.float().cpu())
    print(f"rank {dist.get_rank()}: {name}: {'ok' if ok else 'WRONG'}", flush=True)
    return ok


def collectives(rank, world, dev):
    ok = True
    # 16 KiB goes through host staging; 1 MiB takes nccl-rs's direct path (64 KiB and more).
    for dt, n in [(dt, n) for n in (4096 + 3, (1 << 18) + 3) for dt in (torch.float32, torch.bfloat16)]:
        print(f"rank {rank}: {n} elements", flush=True)
        base = torch.arange(n, device=dev) % 17
        x = (base + rank + 1).to(dt)
        t = x.clone()
        dist.all_reduce(t)
        want = sum((base + r + 1) for r in range(world)).to(dt)
        ok &= check(f"all_reduce {dt}", t, want)
        out = torch.empty(n * world, dtype=dt, device=dev)
        dist.all_gather_into_tensor(out, x)
        ok &= check(f"all_gather_into_tensor {dt}", out, torch.cat([(base + r + 1).to(dt) for r in range(world)]))
        big = torch.cat([(base + r + 1 + 100 * k).to(dt) for k in range(world) for r in [rank]])
        rs = torch.empty(n, dtype=dt, device=dev)
        if ran("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(rs, big)):
            ok &= check(f"reduce_scatter_tensor {dt}", rs, sum((base + r + 1 + 100 * rank) for r in range(world)).to(dt))
        b = x.clone()
        dist.broadcast(b, src=1)
        ok &= check(f"broadcast {dt}", b, (base + 2).to(dt))
        m = 64 if n < 10000 else n // world
        a2a_in = torch.cat([(base[:m] + 10 * rank + k).to(dt) for k in range(world)])
        a2a_out = torch.empty_like(a2a_in)
        if ran("all_to_all_single", lambda: dist.all_to_all_single(a2a_out, a2a_in)):
            ok &= check(f"all_to_all_single {dt}", a2a_out,
                        torch.cat([(base[:m] + 10 * k + rank).to(dt) for k in range(world)]))
        peer = 1 - rank
        s = (base + 1000 * rank).to(dt)
        r = torch.empty_like(s)
        if rank == 0:
            dist.send(s, peer)
            dist.recv(r, peer)
        else:
            dist.recv(r, peer)
            dist.send(s, peer)
        ok &= check(f"send/recv {dt}", r, (base + 1000 * peer).to(dt))
    dist.barrier()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"rank {rank}: barrier: ok", flush=True)
    return ok


def ddp_losses(dev):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    losses = []
    for _ in range(5):
        xb = torch.randn(16, 32, generator=g).to(dev)
        yb = torch.randn(16, 1, generator=g).to(dev)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def stress(rank, world, dev, seconds=10.0):
    """All-reduces on the direct path (4 MiB) while another thread allocates, frees and calls
    torch.cuda.empty_cache() (cudaFree, which waits for the device): nccl-rs's stream worker
    must never need the driver in a way that waits for that thread. Exact results."""
    import threading
    import time
    stop = time.monotonic() + seconds
    errors = []

    def churn():
        k = 0
        while time.monotonic() < stop:
            try:
                x = torch.empty((1 + k % 7) << 20, dtype=torch.uint8, device=dev)
                del x
                torch.cuda.empty_cache()
            except Exception as e:  # reported, not raised in a thread
                errors.append(repr(e))
                return
            k += 1

    t = threading.Thread(target=churn)
    t.start()
    ok, calls = True, 0
    while time.monotonic() < stop:
        v = torch.full((1 << 20,), float(rank + 1 + calls % 3), device=dev)
        dist.all_reduce(v)
        want = float(sum(r + 1 + calls % 3 for r in range(world)))
        if calls % 16 == 0 and not torch.equal(v, torch.full_like(v, want)):
            ok = False
            print(f"rank {rank}: stress: call {calls} WRONG", flush=True)
        calls += 1
    torch.cuda.synchronize()
    t.join()
    ok &= not errors
    print(f"rank {rank}: stress: {calls} all-reduces beside empty_cache: {'ok' if ok else 'FAILED'} {errors}",
          flush=True)
    return ok


def graph(rank, world, dev):
    """An all-reduce, an all-gather and a broadcast captured by torch.cuda.graph (on PyTorch's
    own NCCL stream, joined to the capture by events), replayed three times with new inputs,
    each result exact; then an all-reduce outside the graph, after the replays."""
    ok = True
    n = 5000
    base = torch.arange(n, device=dev) % 17
    x = torch.zeros(n, device=dev)
    gathered = torch.zeros(n * world, device=dev)
    b = torch.zeros(n, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as PyTorch's docs do
        dist.all_reduce(x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dist.all_reduce(x)
        dist.all_gather_into_tensor(gathered, x)
        dist.broadcast(b, src=world - 1)
    for k in range(3):
        x.copy_(base + rank + k)
        b.copy_(base * (rank + 1) + k)
        g.replay()
        torch.cuda.synchronize()
        want = sum(base + r + k for r in range(world)).float()
        ok &= check(f"graph replay {k}: all_reduce", x, want)
        ok &= check(f"graph replay {k}: all_gather_into_tensor", gathered, torch.cat([want] * world))
        ok &= check(f"graph replay {k}: broadcast", b, (base * world + k).float())
    y = base.float() + rank
    dist.all_reduce(y)
    ok &= check("all_reduce after the replays", y, sum(base + r for r in range(world)).float())
    del g
    return ok


def init_nccl(rank, world):
    """The process group on cuda:0 with backend 'nccl' (ours under LD_PRELOAD)."""
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    # A hang becomes an error within a minute (PyTorch's watchdog), not the step's cap.
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev,
                            timeout=datetime.timedelta(seconds=60))
    return dev


def main():
    mode = sys.argv[1]
    if mode == "compare":
        a = json.load(open(os.path.join(OUT, "ddp-nccl.json")))
        b = json.load(open(os.path.join(OUT, "ddp-gloo.json")))
        same = a == b
        diff = max((abs(x - y) for x, y in zip(a, b)), default=0.0)
        print(f"DDP losses nccl-rs: {a}\nDDP losses gloo:    {b}\nRESULT: DDP {'equal' if same else 'DIFFERENT'} "
              f"(largest difference {diff:.3g})")
        sys.exit(0 if same else 1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if mode in ("graph", "stress"):
        dev = init_nccl(rank, world)
        ok = {"graph": graph, "stress": stress}[mode](rank, world, dev)
        print(f"rank {rank}: {mode}: RESULT {'ok' if ok else 'FAILED'}", flush=True)
        dist.destroy_process_group()
        sys.exit(0 if ok else 1)
    if mode == "nccl":
        dev = init_nccl(rank, world)
        ok = collectives(rank, world, dev)
    elif mode == "selftest":
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
        ok = collectives(rank, world, dev)
        dist.destroy_process_group()
        sys.exit(0 if ok else 1)
    else:
        # The same model on the same device as the nccl run, so that only the communication
        # differs (gloo reduces CUDA tensors through the host); the CPU where there is no GPU.
        dev = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
        ok = True
    losses = ddp_losses(dev)
    if rank == 0:
        json.dump(losses, open(os.path.join(OUT, f"ddp-{mode}.json"), "w"))
    print(f"rank {rank}: {mode}: RESULT {'ok' if ok else 'FAILED'} losses {losses}", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
