"""The CUDA paths, on a machine with a GPU (``make test-gpu``; skipped elsewhere, CI included): every sync option
trains a few steps on CUDA with fp16 autocast and the GradScaler (NCCL as the backend), and DGC's own state
survives a resume on CUDA. Options that need two processes run only where there are two GPUs: NCCL gives each
rank a GPU of its own, so one GPU cannot host two ranks. Without a GPU the same code is covered on CPU by the
rest of the suite, and its device placement by tests/test_device.py."""

from __future__ import annotations

import copy
import math
import threading

import pytest
import timm
import torch
from conftest import plain_cfg, records, train
from test_dgc import _ThreadWorld

from algorithms.base import SyncContext
from algorithms.dgc import DGC
from distributed.membership import Membership
from engine.optim import build_optimizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU in sight: make test-gpu runs these")

CUDA = [
    "model=test_resnet", "data=digits", "logger=none", "trainer.progress=false", "trainer.device=cuda", "amp=torch",
    "amp.dtype=float16", "trainer.max_steps=6", "trainer.checkpoint_every=0",
]  # fmt: skip
# sync option -> (processes it needs, overrides that make it do its exchange within 6 steps)
OPTIONS = {
    "allreduce": (1, []),
    "none": (1, []),
    "localsgd": (1, ["sync.k_steps=2"]),
    "adaptive_localsgd": (1, ["sync.init_k_steps=2"]),
    "diloco": (1, ["sync.inner_steps=2"]),
    "streaming diloco": (1, ["sync=diloco", "sync.inner_steps=4", "sync.fragments=2", "sync.delay=1",
                             "sync.quantize=int8"]),
    "decoupled": (1, ["sync.inner_steps=4", "sync.fragments=2", "sync.delay=1"]),
    "decoupled, 2 ranks": (2, ["sync=decoupled", "sync.inner_steps=4", "sync.fragments=2", "sync.delay=1"]),
    "powersgd": (1, ["sync.start_powerSGD_iter=2", "sync.min_compression_rate=1"]),
    "relaxed": (1, ["sync.check_every=2"]),
    "relaxed localsgd": (1, ["sync=relaxed", "sync@sync.inner=localsgd", "sync.inner.k_steps=2"]),
    "dgc": (2, ["sync.min_compress_numel=1024"]),
    "sgp": (2, []),
    "sgp overlap": (2, ["sync=sgp", "sync.overlap=true"]),
    "crossover": (2, []),
    "allreduce, on_failure=continue": (1, ["sync=allreduce", "trainer.on_failure=continue"]),
    "streaming diloco, on_failure=continue": (1, ["sync=diloco", "sync.inner_steps=4", "sync.fragments=2",
                                                  "sync.delay=1", "trainer.on_failure=continue"]),
}  # fmt: skip


@pytest.mark.parametrize("option", OPTIONS)
def test_each_sync_option_trains_on_cuda_with_fp16_and_the_grad_scaler(tmp_path, option):
    nproc, extra = OPTIONS[option]
    sync = [] if any(o.startswith("sync=") for o in extra) else [f"sync={option}"]
    summary, metrics = train(tmp_path, *CUDA, *sync, *extra, f"trainer.nproc={nproc}")
    assert summary["finished"] and summary["steps"] == 6, summary
    train_records = records(metrics, "train")
    assert all(math.isfinite(r["loss"]) for r in train_records)
    assert train_records[0]["loss_scale"] == 65536.0  # the GradScaler's first scale: fp16 with scaling
    assert f"{nproc} x cuda" in (tmp_path / "train.log").read_text()


@pytest.mark.parametrize("option", ["streaming diloco", "powersgd", "localsgd"])
def test_a_run_stopped_on_cuda_resumes_from_its_checkpoint(tmp_path, option):
    """The checkpoint of a CUDA run (the algorithm's shared and own state included) is loaded back onto the GPU and
    the run finishes: the steps after the checkpoint once each."""
    _, extra = OPTIONS[option]
    sync = [] if any(o.startswith("sync=") for o in extra) else [f"sync={option}"]
    common = [o for o in CUDA if not o.startswith("trainer.max_steps=")]
    common += [*sync, *extra, "trainer.nproc=1", "trainer.checkpoint_every_steps=2"]
    train(tmp_path, *common, "trainer.max_steps=4")
    summary, metrics = train(tmp_path, *common, "trainer.max_steps=6", "trainer.resume=auto")
    assert summary["finished"] and summary["steps"] == 6
    assert [r["step"] for r in records(metrics, "train")] == list(range(6))
    (resume,) = [e for e in records(metrics, "event") if e["event"] == "resume"]
    assert resume["path"].endswith("last.pt")


def test_dgc_resumes_on_cuda_exactly_where_it_stopped(tmp_path):
    """Two ranks (threads of this process, one GPU) run DGC past its warm-up; one pair of DGCs saves its own state
    after step 2 as the trainer does, fresh ones load it onto the GPU (``map_location``, as a resume does) and both
    go on. The two runs end bit for bit alike: with two ranks every entry of the sparse update is a sum of at most
    two values, so the GPU's unordered scatter-add cannot round differently."""
    n, steps, device = 2, 5, torch.device("cuda", 0)
    torch.manual_seed(0)
    base = timm.create_model("test_resnet", num_classes=10).to(device)
    numel = sum(p.numel() for p in base.parameters())
    grads = torch.randn(steps, n, numel, generator=torch.Generator().manual_seed(1)).to(device)
    optimizer_cfg = plain_cfg("optimizer=momentum", "trainer.nproc=1", "logger=none")["optimizer"]

    def run(resume_at: int | None):
        world, saved = _ThreadWorld(n), threading.Barrier(n)

        def rank(r: int):
            def fresh():
                model = copy.deepcopy(base)
                opt = build_optimizer(model, optimizer_cfg, lr=0.1)
                dgc = DGC(sparsity=[0.99], min_compress_numel=1024)
                dgc.setup(model, opt, SyncContext(comm=world.comm(r), membership=Membership(r, n), device=device))
                return model, opt, dgc

            model, opt, dgc = fresh()
            for t in range(steps):
                if t == resume_at:
                    path = tmp_path / f"rank{r}.pt"
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sync": dgc.state_dict(),
                                "own": dgc.local_state_dict()}, path)  # fmt: skip
                    saved.wait()
                    model, opt, dgc = fresh()
                    state = torch.load(path, map_location=device, weights_only=True)
                    model.load_state_dict(state["model"])
                    opt.load_state_dict(state["opt"])
                    dgc.load_state_dict(state["sync"])
                    dgc.load_local_state_dict(state["own"])
                    assert dgc.v.device == device and torch.equal(dgc.v, state["own"]["v"])
                for p, g in zip(model.parameters(), grads[t, r].split([p.numel() for p in model.parameters()])):
                    p.grad = g.view(p.shape).clone()
                dgc.after_backward(t, True)
                opt.step()
            return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), dgc.v.clone()

        return world.run(rank)

    uninterrupted, resumed = run(None), run(3)
    for r in range(n):
        assert torch.equal(resumed[r][0], uninterrupted[r][0]) and torch.equal(resumed[r][1], uninterrupted[r][1])


def _exchange_over_nccl(rank: int, init: str, out: str, on_cuda: bool) -> None:
    import os

    import torch.distributed as dist
    from test_transfer import a_state

    from distributed.transfer import recv_state, send_state

    os.environ["NCCL_HOSTID"] = f"relaxsync-test-node{rank}"  # (two "hosts" on one GPU: NCCL connects them by socket)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2)
    try:
        if rank == 0:
            state = a_state()
            if on_cuda:  # (every tensor on the GPU, as a CUDA run's replica is; one held twice stays one)
                state = _on_cuda(state, {})
            send_state(state, dst=1)
        else:
            torch.save(recv_state(src=0), out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_a_state_sent_over_nccl_arrives_on_the_cpu_as_it_was_sent(tmp_path, where):
    """The NCCL branch of distributed/transfer.py: the buffers travel on the GPU and arrive on the CPU, bit for bit,
    with a tensor held twice one object again (the sender's tensors on the CPU or on the GPU)."""
    import torch.multiprocessing as mp
    from test_transfer import a_state, assert_same

    out = tmp_path / "received.pt"
    mp.start_processes(
        _exchange_over_nccl, args=(f"file://{tmp_path}/store", str(out), where == "cuda"), nprocs=2,
        start_method="spawn",
    )  # fmt: skip
    got = torch.load(out, weights_only=False)
    assert all(t.device.type == "cpu" for t in got["model"].values())
    assert_same(got, a_state())
    assert got["tied"] is got["model"]["w"]


def _on_cuda(value, moved: dict):
    """``value`` with every tensor moved to the GPU, containers kept as they are (an OrderedDict, a named tuple),
    a tensor held twice moved once."""
    if isinstance(value, torch.Tensor):
        if id(value) not in moved:
            moved[id(value)] = value.cuda()
        return moved[id(value)]
    if isinstance(value, dict):
        out = value.copy()
        for key, item in value.items():
            out[key] = _on_cuda(item, moved)
        return out
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_on_cuda(item, moved) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cuda(item, moved) for item in value)
    return value


def test_the_gpu_defaults_train_in_bfloat16_channels_last_and_time_on_the_gpu(tmp_path):
    """amp=auto, channels_last auto, cudnn.benchmark: bfloat16 autocast without a loss scale on a GPU that has it;
    compute_s and comm_s are the GPU's own times (CUDA events; NCCL's events for the allreduce), both > 0."""
    common = [o for o in CUDA if not o.startswith("amp")]
    summary, metrics = train(tmp_path, *common, "trainer.nproc=1")
    assert summary["finished"] and summary["steps"] == 6
    steps = records(metrics, "train")
    assert all("loss_scale" not in r for r in steps) == torch.cuda.is_bf16_supported()
    assert all(r["compute_s"] > 0 and r["comm_s"] > 0 for r in steps[1:]), steps
    assert "channels_last" in (tmp_path / "train.log").read_text()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_relaxed_sync_trains_with_apex(tmp_path, opt_level):
    """``python train.py sync=relaxed amp=apex``: apex's loss scale in the records, every loss finite."""
    pytest.importorskip("apex.amp", reason="NVIDIA apex not installed (make apex APEX_SRC=...)")
    common = [o for o in CUDA if not o.startswith("amp")]
    summary, metrics = train(
        tmp_path, *common, "sync=relaxed", "sync.check_every=2", "amp=apex", f"amp.opt_level={opt_level}",
        "trainer.nproc=1",
    )  # fmt: skip
    assert summary["finished"] and summary["steps"] == 6
    steps = records(metrics, "train")
    assert all(math.isfinite(r["loss"]) for r in steps) and steps[0]["loss_scale"] > 1


def test_relaxed_sync_evicts_a_gpu_slow_on_its_device(tmp_path):
    """Three nodes on NCCL (sharing the GPU as NCCL hosts of their own where there is one GPU), the third's GPU
    slowed 5x from epoch 2 (straggler=device: torch.cuda._sleep on its stream, its CPU at full speed): relaxed sync,
    measuring each rank's compute on its GPU, evicts it at the first check after (step 21)."""
    from test_faults import SHRINK, finish, start_nodes

    run_dir = tmp_path / "run"
    overrides = [o for o in SHRINK if not o.startswith(("trainer.on_failure", "trainer.hang_timeout_s"))]
    nodes = start_nodes(
        3, run_dir, *overrides, "trainer.device=cuda", "trainer.epochs=2", "sync=relaxed",
        "sync.relaxed_sync_threshold=2.0", "sync.check_every=7", "straggler=device", "straggler.start_epoch=2",
        "straggler.ranks=[2]", "straggler.slowdown=5.0",
    )  # fmt: skip
    metrics = finish(nodes, run_dir)
    (evict,) = [e for e in records(metrics, "event") if e["event"] == "evict"]
    assert evict["ranks"] == [2] and evict["measure"] == "compute", evict
    assert evict["times"]["2"] > 2.0 * evict["reference"]


def test_gpu_decoded_batches_equal_cpu_decoded_ones_with_writes_queued_on_the_stream(tmp_path):
    """The nvJPEG ordering hazard: over 200 batches, each decoded on the GPU after writes were queued on the stream
    into blocks the allocator hands straight back (``bench.decode.queue_writes``), against the CPU decode of the same
    files and crops. Without the drain before each decode (``FileStage.drain``) the writes land on decoded images
    (torchvision saw 134 of 200 iterations corrupted on an H100); with it, every image's mean difference stays
    within torchvision's own bound for nvJPEG against libjpeg-turbo."""
    from bench.decode import agreement
    from bench.jpegs import write_tree

    write_tree(tmp_path / "tree", 256, 16)
    result = agreement(tmp_path / "tree", "cuda", batch=32, batches=200, size=224)
    assert result["agree_failed_batches"] == 0, result


def test_train_py_decodes_jpegs_on_the_gpu(tmp_path):
    """``data.decode=auto`` on CUDA decodes on the GPU: a run on an ImageNet-like tree (odd files among the JPEGs)
    trains and evaluates every validation image."""
    from bench.jpegs import write_tree

    write_tree(tmp_path / "tree", 64, 16, size=(160, 120), jitter=20, odd_every=4)
    base = [o for o in CUDA if not o.startswith(("data=", "trainer.max_steps"))]
    summary, metrics = train(
        tmp_path / "run", *base, "data=imagefolder", f"data.root={tmp_path / 'tree'}", "data.image_size=64",
        "data.batch_size=16", "trainer.epochs=2", "trainer.nproc=1",
    )  # fmt: skip
    assert summary["finished"] and records(metrics, "eval")[-1]["num_samples"] == 16
    assert all(math.isfinite(r["loss"]) for r in records(metrics, "train"))
